"""Layer-wise KV streaming over real processes: prefill pushes each layer of a chunk's blocks as it is
computed, decode assembles the layers, and the answer is the one `mooncake generate` gives."""

import json
import subprocess
import sys

import pytest

from tests.e2e.conftest import make_cluster, metrics, post

pytestmark = pytest.mark.slow  # make test skips it; make test-all and .ci/run run it


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    with make_cluster(tmp_path_factory, "tcp", **{"instance.stream_layers": True}) as c:
        yield c


def test_a_hand_off_by_layers_is_token_identical_and_decode_computes_nothing_again(cluster):
    prompt = "Layer by layer, the quick brown fox jumps over the lazy dog. " * 3  # several chunks and blocks
    body = {"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": 16, "ignore_eos": True,
            "return_token_ids": True}
    status, reply = post(cluster.url + "/v1/completions", body)
    assert status == 200, reply
    config = cluster.process("prefill-0").config_path
    out = subprocess.run([sys.executable, "-m", "mooncake", "generate", "--config", str(config), "--prompt", prompt,
                          "--max-tokens", "16", "--json"], capture_output=True, text=True, timeout=300, check=True)
    assert reply["choices"][0]["token_ids"] == json.loads(out.stdout)["token_ids"]
    assert metrics(cluster.url).get('mooncake_kv_transfer_bytes_total{instance="prefill-0"}', 0.0) > 0
    decode_log = (cluster.workdir / "decode-0.log").read_text()
    assert "computing the rest here" not in decode_log  # every block's every layer arrived and was claimed

    # The same prompt again: its blocks are prefill's cached prefix now, so they go whole, not by layer.
    status, again = post(cluster.url + "/v1/completions", body)
    assert status == 200 and again["choices"][0]["token_ids"] == reply["choices"][0]["token_ids"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert "computing the rest here" not in (cluster.workdir / "decode-0.log").read_text()

"""CPP over real processes: with conductor.cpp_stages = 2, a prompt over the threshold runs on both prefill
instances as a two-stage pipeline (activations over TCP between them, each stage's layers to decode), and
the answer is the one `mooncake generate` gives; a short prompt still goes to one instance; a stage lost
mid-prompt costs the stream nothing (the request moves to what is left)."""

import json
import signal
import subprocess
import sys

import pytest

from tests.e2e.conftest import indexed, make_cluster, metrics, post, wait_for
from tests.e2e.test_migration import Stream, assert_idle, holders, story, undisturbed

pytestmark = pytest.mark.slow  # make test skips it; make test-all and .ci/run run it


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    with make_cluster(tmp_path_factory, "tcp", num_prefill=2, **{
            "conductor.cpp_stages": 2, "conductor.cpp_threshold_tokens": 64, "conductor.cpp_chunk_tokens": 32}) as c:
        yield c


def generate(cluster, prompt, max_tokens):
    config = cluster.process("prefill-0").config_path
    out = subprocess.run([sys.executable, "-m", "mooncake", "generate", "--config", str(config), "--prompt", prompt,
                          "--max-tokens", str(max_tokens), "--json"], capture_output=True, text=True, timeout=300,
                         check=True)
    return json.loads(out.stdout)["token_ids"]


def test_a_long_prompt_runs_on_a_group_and_gives_one_instances_tokens(cluster):
    prompt = "Chunked pipeline parallelism splits a long prompt over a group of nodes. " * 8
    body = {"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": 12, "ignore_eos": True,
            "return_token_ids": True}
    status, reply = post(cluster.url + "/v1/completions", body)
    assert status == 200, reply
    assert reply["usage"]["prompt_tokens"] > 64
    assert reply["choices"][0]["token_ids"] == generate(cluster, prompt, 12)
    logs = [(cluster.workdir / f"prefill-{i}.log").read_text() for i in range(2)]
    assert not any("CPP stage" in log and "failed" in log for log in logs)
    assert sum("first token from a 2-stage CPP pipeline" in log for log in logs) == 1  # on the last stage
    assert "computing the rest here" not in (cluster.workdir / "decode-0.log").read_text()  # every layer came

    short = "Short prompt."
    status, reply = post(cluster.url + "/v1/completions", {**body, "prompt": short, "max_tokens": 4})
    assert status == 200 and reply["choices"][0]["token_ids"] == generate(cluster, short, 4)


def test_a_long_prompt_whose_prefix_is_in_the_pool_reads_it_on_every_stage(cluster):
    """A short prompt runs on one instance, which writes its blocks to the pool; a long prompt that starts
    with it runs on the group, every stage reading that prefix from the pool and computing only the rest,
    and the answer is still the one `mooncake generate` gives."""
    head = "A prefix that one instance computes and writes to the pool. "  # 60 tokens
    body = {"model": "tiny", "temperature": 0, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True}
    fetched = sum(v for k, v in metrics(cluster.url).items() if k.startswith("mooncake_kv_fetch_bytes"))
    pooled = sum(v for k, v in metrics(cluster.url).items() if k.startswith("mooncake_cache_blocks"))
    known = indexed(cluster.url, "cache-")
    status, reply = post(cluster.url + "/v1/completions", {**body, "prompt": head})
    assert status == 200 and reply["usage"]["prompt_tokens"] <= 64, reply  # under the threshold: one instance
    wait_for(lambda: sum(v for k, v in metrics(cluster.url).items() if k.startswith("mooncake_cache_blocks"))
             >= pooled + reply["usage"]["prompt_tokens"] // 16, 10, "the short prompt's blocks in the pool")
    wait_for(lambda: indexed(cluster.url, "cache-") >= known + reply["usage"]["prompt_tokens"] // 16, 10,
             "the conductor's prefix index hears of them from the pool")
    logs = lambda: sum(((cluster.workdir / f"prefill-{i}.log").read_text().count("2-stage CPP pipeline")
                        for i in range(2)))
    groups = logs()
    prompt = head + "Then a long tail that only this request has, so the group computes it in chunks. " * 4
    status, reply = post(cluster.url + "/v1/completions", {**body, "prompt": prompt})
    assert status == 200 and reply["usage"]["prompt_tokens"] > 64, reply
    assert logs() == groups + 1  # it ran on the group
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16  # read from the pool, not computed
    assert sum(v for k, v in metrics(cluster.url).items() if k.startswith("mooncake_kv_fetch_bytes")) > fetched
    assert reply["choices"][0]["token_ids"] == generate(cluster, prompt, 6)


def test_a_groups_prompt_reaches_the_pool_through_decode_and_is_reused_from_there(cluster):
    """Each stage holds only its layers, so decode, the first to hold the blocks whole, writes them to the
    pool; the same prompt again reads them from there on the group."""
    pooled = lambda: sum(v for k, v in metrics(cluster.url).items() if k.startswith("mooncake_cache_blocks"))
    prompt = "A long prompt that a group computes cold, and that decode then writes to the pool. " * 4
    body = {"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": 6, "ignore_eos": True,
            "return_token_ids": True}
    before, known = pooled(), indexed(cluster.url, "cache-")
    status, first = post(cluster.url + "/v1/completions", body)
    assert status == 200 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, first
    full_blocks = (first["usage"]["prompt_tokens"] - 1) // 16
    wait_for(lambda: pooled() >= before + full_blocks, 10, "the group's blocks in the pool")
    wait_for(lambda: indexed(cluster.url, "cache-") >= known + full_blocks, 10,
             "the conductor's prefix index hears of them from the pool")
    status, again = post(cluster.url + "/v1/completions", body)
    assert status == 200 and again["usage"]["prompt_tokens_details"]["cached_tokens"] == full_blocks * 16, again
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


def test_a_stage_lost_mid_prompt_costs_the_stream_nothing(cluster):
    body = {**story(max_tokens=24), "prompt": story()["prompt"] * 3}  # over the threshold: a group of both
    moved = metrics(cluster.url).get('mooncake_migrations_total{outcome="moved"}', 0.0)
    cluster.kill("prefill-1", signal.SIGSTOP)  # the last stage: stage 0 waits on it
    try:
        stream = Stream(cluster.url, body)
        wait_for(lambda: holders(cluster, "prefill") == ["prefill-0", "prefill-1"], 10, "the group holds the request")
        cluster.kill("prefill-1", signal.SIGKILL)
        tokens = stream.result()
        # NOTE: the one prefill instance left cannot form a group, so the request moved to it whole.
        assert metrics(cluster.url).get('mooncake_migrations_total{outcome="moved"}', 0.0) == moved + 1
    finally:
        cluster.kill("prefill-1", signal.SIGKILL)
        cluster.spawn(cluster.process("prefill-1"))
    cluster.wait_ready(120)
    assert tokens == undisturbed(cluster, body)
    assert_idle(cluster, 10)  # stage 0 let its part go: nothing held anywhere

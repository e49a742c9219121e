"""A cache node restarted after `kill -9` comes back with the blocks it had written to SSD, and the
conductor's placement reuses them: its snapshot puts them back in the prefix index (events alone never
announced blocks recovered from disk)."""

import signal

import pytest

from tests.e2e.conftest import make_cluster, metrics, post, wait_for

pytestmark = pytest.mark.slow  # make test skips it; make test-all and .ci/run run it

BLOCK = 16
NUM_BLOCKS = 12


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    ssd = tmp_path_factory.mktemp("ssd")
    # DRAM holds about three of the tiny model's 16 KiB blocks: the rest of a prompt goes down to SSD.
    with make_cluster(tmp_path_factory, "tcp", **{"store.dram_bytes": 64 << 10, "store.ssd_dir": str(ssd),
                                                   "store.ssd_bytes": 64 << 20}) as c:
        yield c


def test_a_restarted_cache_nodes_ssd_blocks_are_reused_through_placement(cluster):
    prompt = [10 + (i * 37) % 200 for i in range(NUM_BLOCKS * BLOCK)]
    before = pooled(cluster)
    status, reply = post(cluster.url + "/v1/completions", {"model": "tiny", "prompt": prompt + [5], "max_tokens": 2})
    assert status == 200 and reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_for(lambda: pooled(cluster) >= before + NUM_BLOCKS, 10, "the pool writes land (the older on SSD)")
    for name in ("cache-0", "prefill-0"):  # the prefill instance's own copy goes too
        cluster.kill(name, signal.SIGKILL)
        cluster.spawn(cluster.process(name))
    cluster.wait_ready(120)
    wait_for(lambda: cluster.health().get("cache") == ["cache-0"], 30, "the restarted cache node indexed")
    # The new prefill process has registered once an unrelated request is served.
    wait_for(lambda: post(cluster.url + "/v1/completions", {"model": "tiny", "prompt": [7, 8, 9],
                                                            "max_tokens": 1})[0] == 200, 30, "prefill back")
    fetched = 'mooncake_kv_fetch_bytes_total{instance="prefill-0"}'
    before = metrics(cluster.url).get(fetched, 0.0)
    status, reply = post(cluster.url + "/v1/completions", {"model": "tiny", "prompt": prompt + [6], "max_tokens": 2})
    assert status == 200
    # What was in DRAM died with the process; what had reached SSD is read back instead of computed.
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= (NUM_BLOCKS - 4) * BLOCK
    assert metrics(cluster.url).get(fetched, 0.0) > before


def pooled(cluster) -> float:
    """Blocks held in the pool, every node and tier, as the conductor last heard."""
    return sum(v for k, v in metrics(cluster.url).items() if k.startswith("mooncake_cache_blocks{"))

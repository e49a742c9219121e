"""The conductor's view of the cache pool against a real cache node process: a snapshot fills the index
(blocks the node recovered from SSD included), a node that dies leaves the index at once, and a node that
restarts is indexed again from its new snapshot."""

import asyncio
import signal
import time

from mooncake.conductor.pool_watch import PoolWatcher
from mooncake.conductor.prefix_index import PrefixIndex
from mooncake.config import CacheClientConfig
from mooncake.store.client import CacheClient
from tests.store.test_cache_role import blocks, nodes  # noqa: F401  (the fixture)


async def wait_until(condition, what: str, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def test_the_index_follows_a_node_that_dies_and_comes_back_with_its_ssd_blocks(nodes, tmp_path):
    size = 64 * 1024
    # DRAM holds two blocks: the rest are demoted to SSD, where they survive a kill -9.
    node = nodes(dram_bytes=2 * size, ssd_bytes=1 << 28, ssd_dir=tmp_path / "ssd")
    data = blocks(12, size=size, seed=11)
    keys = {k for k, _ in data}

    async def run():
        client = CacheClient(CacheClientConfig(nodes=(node.control,), timeout_s=2.0))
        await client.start()
        try:
            assert all(e is None for e in (await client.put_blocks(data)).values())
        finally:
            await client.stop()
        index = PrefixIndex()
        watcher = PoolWatcher((node.control,), index, timeout_s=1.0)
        watcher.start()  # after the writes: only a snapshot can tell it what the node holds
        try:
            await wait_until(lambda: index.holders(data[-1][0]) == {"cache-0"}, "the snapshot was not indexed")
            assert all(index.holders(k) == {"cache-0"} for k in keys)
            assert watcher.live_ids == {"cache-0"}

            node.stop(signal.SIGKILL)
            await wait_until(lambda: len(index) == 0, "a dead node's blocks stayed in the index")
            assert watcher.live_ids == frozenset()

            node.start()  # same SSD directory: it recovers what reached the disk
            await wait_until(lambda: watcher.live_ids == {"cache-0"}, "the restarted node was not indexed again")
            recovered = {k for k in keys if index.holders(k) == {"cache-0"}}
            assert len(recovered) >= len(keys) - 2  # all but what was still in DRAM
        finally:
            await watcher.stop()
    asyncio.run(run())

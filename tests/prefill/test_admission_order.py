"""A prefill instance's requests enter its engine in the order they came when it prefills serially (the
queue the conductor predicts): one that first reads its prefix from the cache pool is not overtaken by a
later one that reads nothing. With budget batching nothing waits."""

import asyncio
from types import SimpleNamespace

import pytest

from mooncake import messages as m
from mooncake.config import load_config
from mooncake.prefill.worker import PrefillWorker
from mooncake.sampling import WireSampling


class SlowPool:
    """A cache pool whose reads wait until released, then miss (the prompt is computed)."""

    def __init__(self):
        self.release = asyncio.Event()

    async def get_blocks(self, keys):
        await self.release.wait()
        return {}


class RecordingLoop:
    """The engine loop, reduced to the order in which requests enter the engine, over an engine with no
    prefix cached."""

    def __init__(self, serial: bool):
        self.entered = []
        self.facts = SimpleNamespace(serial_prefill=serial)

    def prefix_length(self, block_hashes):
        return 0

    async def prepare_grammars(self, params):
        pass

    async def add_request(self, token_ids, params, request_id, keep_kv=False):
        self.entered.append(request_id)


def prefill(request_id: str, reuse_blocks: int) -> m.Prefill:
    return m.Prefill(request_id=request_id, token_ids=list(range(40)), block_hashes=[1, 2], sampling=WireSampling(),
                     decode_id="decode-0", decode_transport="tcp", decode_address="", reuse_blocks=reuse_blocks)


def make_worker(serial: bool) -> PrefillWorker:
    """A prefill worker up to its engine: an engine with no prefix cached, entries recorded, a slow pool."""
    worker = PrefillWorker(load_config(None))
    worker.loop, worker.cache, worker.transfer_s_per_block = RecordingLoop(serial), SlowPool(), 0.0
    return worker


@pytest.mark.parametrize("serial, expected", [(True, ["reads-the-pool", "reads-nothing"]),
                                              (False, ["reads-nothing", "reads-the-pool"])])
def test_a_request_reading_the_pool_keeps_its_place_only_under_serial_prefill(serial, expected):
    async def main():
        worker = make_worker(serial)
        first = asyncio.create_task(worker._admit(prefill("reads-the-pool", reuse_blocks=2)))
        second = asyncio.create_task(worker._admit(prefill("reads-nothing", reuse_blocks=0)))
        await asyncio.sleep(0.05)
        assert worker.loop.entered == (expected[:1] if not serial else [])
        worker.cache.release.set()
        await asyncio.wait_for(asyncio.gather(first, second), 5)
        assert worker.loop.entered == expected

    asyncio.run(main())


def test_a_request_dropped_while_reading_the_pool_lets_the_next_one_in():
    async def main():
        worker = make_worker(serial=True)
        first = asyncio.create_task(worker._admit(prefill("dropped", reuse_blocks=2)))
        second = asyncio.create_task(worker._admit(prefill("next", reuse_blocks=0)))
        await asyncio.sleep(0.05)
        first.cancel()  # the conductor cancelled it while it read the pool
        await asyncio.wait_for(second, 5)
        assert worker.loop.entered == ["next"]

    asyncio.run(main())


def test_a_request_cancelled_while_its_grammar_is_prepared_never_enters_the_engine():
    """The first structured output prepares the engine's grammar tokenizer (about a second, on a side
    thread): a Cancel that comes meanwhile is seen before the request would enter."""
    class GrammarLoop(RecordingLoop):
        def __init__(self):
            super().__init__(serial=True)
            self.prepared = asyncio.Event()

        async def prepare_grammars(self, params):
            await self.prepared.wait()

        async def abort(self, request_id):
            pass

    async def main():
        worker = make_worker(serial=True)
        worker.loop = GrammarLoop()
        admission = asyncio.create_task(worker._admit(prefill("structured", reuse_blocks=0)))
        await asyncio.sleep(0.05)
        await worker.drop("structured")  # the conductor's Cancel
        worker.loop.prepared.set()
        await asyncio.wait_for(admission, 5)
        assert worker.loop.entered == [] and "structured" not in worker.jobs

    asyncio.run(main())

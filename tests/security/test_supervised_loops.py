"""Every loop is supervised (issue: an instance's engine loop was an unsupervised task: one exception in
`on_outputs` stopped it while heartbeats went on, a zombie that kept receiving work). A role's engine
loop, its cache client's probe and the conductor's pool watch each fail the role's `fatal` when they die,
and `run_service` then ends the process with a non-zero exit (tests/test_supervisor.py)."""

import asyncio

import pytest

from mooncake.config import load_config
from mooncake.decode.worker import DecodeWorker
from mooncake.dev import free_port
from mooncake.engine import SamplingParams
from mooncake.errors import MooncakeError
from mooncake.store.client import CacheClient
from tests.api.test_api import Served


def _decode_config(**overrides):
    return load_config(None, {"engine.model": "tiny-llama", "engine.block_size": 16, "engine.num_kv_blocks": 64,
                              "instance.transport": "tcp", "instance.use_cache_pool": False,
                              "instance.conductor_address": f"tcp://127.0.0.1:{free_port()}", **overrides})


async def _fatal_of(worker: DecodeWorker, timeout_s: float = 30.0) -> None:
    await asyncio.wait_for(asyncio.shield(worker.fatal), timeout_s)


def test_an_engine_loop_that_dies_ends_its_instance(tiny_dir):
    async def main():
        worker = DecodeWorker(_decode_config())
        await worker.start()
        try:
            async def broken(outputs):
                raise RuntimeError("a bug in on_outputs")
            worker.loop.on_outputs = broken
            await worker.loop.add_request([5, 6, 7], SamplingParams(max_tokens=4), "r1")
            with pytest.raises(MooncakeError, match="the engine loop failed.*a bug in on_outputs"):
                await _fatal_of(worker)
        finally:
            await worker.stop()
    asyncio.run(main())


def test_a_cache_client_probe_that_dies_ends_its_instance(tiny_dir, monkeypatch):
    async def broken(self):
        await asyncio.sleep(0.05)
        raise RuntimeError("a bug in the probe")
    monkeypatch.setattr(CacheClient, "_probe_down_nodes", broken)

    async def main():
        # a cache node nobody runs: the client starts with it down, and probes for it
        worker = DecodeWorker(_decode_config(**{"instance.use_cache_pool": True,
                                                "cache_client.nodes": [f"tcp://127.0.0.1:{free_port()}"],
                                                "cache_client.timeout_s": 0.2}))
        await worker.start()
        try:
            assert worker.pool.client is not None
            with pytest.raises(MooncakeError, match="probe of down nodes failed.*a bug in the probe"):
                await _fatal_of(worker)
        finally:
            await worker.stop()
    asyncio.run(main())


def test_a_pool_watch_that_dies_ends_the_conductor(tiny_dir, monkeypatch):
    from mooncake.conductor.pool_watch import PoolWatcher

    async def broken(self):
        await asyncio.sleep(0.05)
        raise RuntimeError("a bug in the stats poll")
    monkeypatch.setattr(PoolWatcher, "_poll_stats", broken)
    served = Served()
    try:
        fatal = served.conductor.fatal

        async def wait():
            await asyncio.wait_for(asyncio.shield(fatal), 10)
        with pytest.raises(MooncakeError, match="stats poll failed.*a bug in the stats poll"):
            asyncio.run_coroutine_threadsafe(wait(), served.loop).result(20)
    finally:
        served.close()

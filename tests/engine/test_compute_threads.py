"""Only the engine's thread computes in parallel in an instance (mooncake/instance/compute_threads.py): a
thread that computes alone starts no OpenMP workers however large its work, and an EngineLoop started by
`start_engine` steps on the thread that built the engine, with its KV copy thread and the event loop's
default executor computing alone."""

import asyncio
import os
import threading

import pytest
import torch

from mooncake.config import EngineConfig
from mooncake.instance import compute_threads
from mooncake.instance import engine_loop
from mooncake.instance.engine_loop import EngineLoop

_needs_threads = pytest.mark.skipif(torch.get_num_threads() < 2 or not compute_threads._per_thread_setters(),
                                reason="needs torch on libgomp with two threads or more")


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _big_parallel_op() -> int:
    """The OS threads that started while this thread scaled a large tensor and multiplied two matrices
    (threads that end meanwhile, other tests' leftovers, do not count)."""
    before = _threads()
    a = torch.ones(2048, 2048).mul_(3.0)
    a[:512, :512] @ a[:512, :512]
    return len(_threads() - before)


def _on_fresh_thread(fn, alone: bool):
    out = {}

    def run():
        if alone:
            compute_threads.compute_alone()
        out["value"] = fn()
    thread = threading.Thread(target=run)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the work did not end within 120 s"
    return out["value"]


@_needs_threads
def test_a_thread_that_computes_alone_starts_no_openmp_workers():
    assert _on_fresh_thread(_big_parallel_op, alone=False) >= 1  # the control: a fresh thread starts its pool
    assert _on_fresh_thread(_big_parallel_op, alone=True) == 0
    assert _on_fresh_thread(torch.get_num_threads, alone=True) == 1


async def _nothing(*args):
    return None


@_needs_threads
def test_start_engine_builds_and_steps_on_one_thread_and_the_side_threads_compute_alone(tiny_dir, monkeypatch):
    config = EngineConfig(model=str(tiny_dir), block_size=8, num_kv_blocks=64)
    seen = {}

    class Recorded(engine_loop.LLMEngine):
        def __init__(self, *args):
            seen["built_on"] = threading.get_ident()
            super().__init__(*args)
    monkeypatch.setattr(engine_loop, "LLMEngine", Recorded)

    async def main():
        loop = await EngineLoop.start_engine(config, _nothing, _nothing)
        loop.start()
        try:
            seen["engine"] = await loop.call_on_engine_thread(torch.get_num_threads)
            seen["engine_thread"] = await loop.call_on_engine_thread(threading.get_ident)
            seen["default_executor"] = await asyncio.to_thread(torch.get_num_threads)
            seen["kv_copy"] = await asyncio.wrap_future(loop._kv_executor.submit(torch.get_num_threads))
        finally:
            await loop.stop()

    # NOTE: on a thread of its own, so that nothing of this test's event loop outlives it
    _on_fresh_thread(lambda: asyncio.run(main()), alone=False)
    assert seen["engine"] == torch.get_num_threads()
    assert seen["built_on"] == seen["engine_thread"]
    assert seen["default_executor"] == 1 and seen["kv_copy"] == 1


def test_dev_instances_spin_briefly_unless_the_user_chose(monkeypatch):
    from mooncake import dev
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert dev._environment("decode")["GOMP_SPINCOUNT"] == dev.DEV_SPIN_COUNT
    assert dev._environment("prefill")["GOMP_SPINCOUNT"] == dev.DEV_SPIN_COUNT
    assert "GOMP_SPINCOUNT" not in dev._environment("api")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert "GOMP_SPINCOUNT" not in dev._environment("decode")

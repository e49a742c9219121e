"""The engine loop's calls (mooncake/instance/engine_loop.py): long work queued with
`call_on_engine_thread` runs on the engine's thread between two steps, never beside one, while the event
loop goes on serving; a failure reaches its caller and the loop keeps stepping."""

import asyncio
import threading
import time

import pytest

from mooncake.engine import LLMEngine, SamplingParams
from mooncake.instance.engine_loop import EngineLoop


async def _nothing(*args):
    return None


def test_long_work_runs_on_the_engine_thread_between_steps_while_the_event_loop_serves(cfg):
    engine = LLMEngine(cfg)
    in_step = threading.Event()
    real_step = engine.step

    def step(since=None):
        in_step.set()
        try:
            return real_step(since)
        finally:
            in_step.clear()
    engine.step = step

    async def main():
        loop = EngineLoop(engine, _nothing, _nothing)
        loop.start()
        seen = {}

        def work(seconds):
            seen["thread"] = threading.current_thread().name
            seen["beside_a_step"] = in_step.is_set()
            steps_before = len(loop.step_samples)
            time.sleep(seconds)
            seen["steps_meanwhile"] = len(loop.step_samples) - steps_before
            return "done"

        def broken():
            raise RuntimeError("the stage lost its device")

        await loop.call(engine.add_request, [5] * 20, SamplingParams(max_tokens=400, ignore_eos=True), "r1")
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1
        ticker = asyncio.create_task(tick())
        try:
            assert await loop.call_on_engine_thread(work, 0.3) == "done"
            with pytest.raises(RuntimeError, match="lost its device"):
                await loop.call_on_engine_thread(broken)
            steps = len(loop.step_samples)
            await asyncio.sleep(0.2)
            assert len(loop.step_samples) > steps  # the loop keeps stepping after a failed call
        finally:
            ticker.cancel()
            await loop.stop()
        return seen, ticks

    seen, ticks = asyncio.run(main())
    assert seen["thread"].startswith("engine") and not seen["beside_a_step"] and seen["steps_meanwhile"] == 0
    assert ticks >= 15  # the event loop ran its 10 ms ticks while the work took 0.3 s

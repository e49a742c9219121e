"""The engine loop's calls (mooncake/instance/engine_loop.py): long work queued with
`call_on_engine_thread` runs on the engine's thread between two steps, never beside one, while the event
loop goes on serving; a failure reaches its caller and the loop keeps stepping."""

import asyncio
import threading
import time

import pytest
import torch

from mooncake.engine import LLMEngine, SamplingParams
from mooncake.engine.stage import PipelineStage, stage_layers
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


def test_the_door_reads_the_engine_only_between_steps(cfg, monkeypatch):
    """What the roles read through the loop: heartbeat stats and the prefix cache as of the last gap
    between steps (a mirror kept from the engine's events; a snapshot once more changed than the log
    keeps), and reads for on_outputs that refuse to run beside a step."""
    from mooncake.instance import engine_loop
    engine = LLMEngine(cfg)
    seen = {}

    async def on_outputs(outputs):
        for out in outputs:
            seen[out.request_id] = loop.forwarded_tokens(out.request_id)

    async def main():
        nonlocal loop
        loop = EngineLoop(engine, on_outputs, _nothing)
        assert loop.facts.block_size == cfg.block_size and loop.facts.num_kv_blocks == engine.block_pool.num_blocks
        loop.start()
        try:
            prompt = list(range(1, 30))  # three full blocks of 8 before the last token
            await loop.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True), "r1", keep_kv=True)
            while engine.has_unfinished() or not seen:
                await asyncio.sleep(0.01)
            # read from on_outputs, between steps: the prompt and the two tokens fed back after the first
            assert seen["r1"] == len(prompt) + 2
            assert loop.stats.output_tokens.get("r1") == 3 and loop.stats.num_running == 0
            completion, forwarded = await loop.complete("r1")
            assert len(completion.token_ids) == 3 and forwarded == len(prompt) + 2
            await loop.call(lambda: None)  # one more gap between steps
            cached = loop.cache_snapshot()
            assert len(cached) >= 3
            assert loop.prefix_length(cached[:2]) == 2
            assert loop.prefix_length([cached[0], 12345, cached[1]]) == 1  # a prefix stops at the first miss
            assert loop.take_cache_changes() == ([], [])  # the snapshot took every change so far
            monkeypatch.setattr(engine_loop, "CACHE_LOG_LIMIT", 2)
            await loop.add_request(list(range(40, 80)), SamplingParams(max_tokens=1), "r2")
            while engine.has_unfinished():
                await asyncio.sleep(0.01)
            await loop.call(lambda: None)
            assert loop.take_cache_changes() is None  # more than the log keeps: a snapshot is due
            assert len(loop.cache_snapshot()) > len(cached)
            assert loop.take_cache_changes() == ([], [])
            loop._stepping = True  # NOTE: as during a step
            with pytest.raises(RuntimeError, match="while a step runs"):
                loop.num_full_blocks("r2")
            loop._stepping = False
        finally:
            await loop.stop()
    loop = None
    asyncio.run(main())


def test_the_first_structured_output_builds_its_grammar_tokenizer_off_the_engine_thread(cfg):
    """The grammar tokenizer (about a second to build) is built on a side thread before the request enters,
    so the streams the engine is stepping do not wait for it; the request then decodes under its grammar."""
    engine = LLMEngine(cfg)
    built_on = []
    load = engine.grammars._hf_tokenizer

    def tokenizer():
        built_on.append(threading.current_thread().name)
        return load()
    engine.grammars._hf_tokenizer = tokenizer
    outputs = []

    async def collect(batch):
        outputs.extend(batch)

    async def main():
        loop = EngineLoop(engine, collect, _nothing)
        loop.start()
        try:
            await loop.add_request([5] * 20, SamplingParams(max_tokens=3, grammar='start: "ab" | "cd"'), "r1")
            for _ in range(200):
                if any(o.request_id == "r1" and o.finished for o in outputs):
                    break
                await asyncio.sleep(0.01)
        finally:
            await loop.stop()

    asyncio.run(main())
    # not on the engine's thread, nor on the event loop's (calls between steps run there)
    assert len(built_on) == 1 and not built_on[0].startswith("engine") and built_on[0] != threading.main_thread().name
    assert [o.finished for o in outputs if o.request_id == "r1"][-1]


def test_a_stage_chunk_waits_for_its_turn_in_the_steps_and_a_cancelled_one_leaves_the_queue(cfg):
    """A CPP stage's chunk (`run_stage_chunk`) is computed in the loop's steps, on the engine's thread, after
    the steps of a prompt that arrived before its request; cancelled while it waits, it leaves the queue
    and nothing of it is computed."""
    engine = LLMEngine(cfg)
    stage = PipelineStage(engine, stage_layers(engine.runner.kv_spec.num_layers, 2)[0])
    reference = PipelineStage(LLMEngine(cfg), stage.layers)
    steps = threading.Semaphore(0)
    ran = []  # per step: what it computed, on which thread
    real_step = engine.step

    def step(since=None):
        assert steps.acquire(timeout=10)
        before = {rid: job.done for rid, job in stage.jobs.items()}
        outputs = real_step(since)
        kind = "stage" if {rid: job.done for rid, job in stage.jobs.items()} != before else "prompt"
        ran.append((kind, threading.current_thread().name))
        return outputs
    engine.step = step
    engine.add_request([7] * 40, SamplingParams(max_tokens=1), "p")  # 3 steps of 16 tokens, arrived first
    stage.begin("s1", [5] * 20)
    reference.begin("s1", [5] * 20)

    async def main():
        loop = EngineLoop(engine, _nothing, _nothing)
        loop.start()
        try:
            first = asyncio.ensure_future(loop.run_stage_chunk(stage, "s1", 20, None))
            steps.release()  # the prompt's first step; the chunk is queued after it
            while not engine.scheduler.stage_chunks:
                await asyncio.sleep(0.01)
            steps.release(2)
            await asyncio.sleep(0.2)
            assert not first.done()  # the prompt's steps first: it arrived before the stage's request
            steps.release()
            out = await asyncio.wait_for(first, 10)
            # a prompt arrives, then the stage's second request; its chunk is queued behind the prompt's steps
            await loop.call(engine.add_request, [8] * 40, SamplingParams(max_tokens=1), "q")
            began = asyncio.ensure_future(loop.call(stage.begin, "s2", [6] * 20))
            steps.release()
            await asyncio.wait_for(began, 10)
            cancelled = asyncio.ensure_future(loop.run_stage_chunk(stage, "s2", 20, None))
            steps.release()
            while not engine.scheduler.stage_chunks:
                await asyncio.sleep(0.01)
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            steps.release(100)
            for _ in range(100):
                if not engine.scheduler.stage_chunks:
                    break
                await asyncio.sleep(0.01)
            return out
        finally:
            steps.release(100)
            await loop.stop()

    out = asyncio.run(main())
    assert [kind for kind, _ in ran[:4]] == ["prompt"] * 3 + ["stage"]
    assert all(thread.startswith("engine") for _, thread in ran)
    torch.testing.assert_close(out, reference.run("s1", 20, None), atol=1e-4, rtol=1e-4)
    assert stage.jobs["s2"].done == 0 and not engine.scheduler.stage_chunks
    assert [kind for kind, _ in ran[4:]] == ["prompt"] * 3  # the prompt's steps alone

"""KV moves that run beside engine steps: an import in three phases (reserve, write on another thread,
enter) and an export of pinned blocks, in the engine and through the engine loop's KV thread."""

import asyncio
import threading

import pytest

from mooncake.engine import LLMEngine, SamplingParams
from mooncake.engine.kv_import import PendingImport
from mooncake.errors import InvalidRequestError
from mooncake.instance.engine_loop import EngineLoop

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def source(cfg):
    return LLMEngine(cfg)


def exported(engine: LLMEngine, ids: list[int]):
    """The prompt's full blocks as a prefill instance would send them."""
    rid = engine.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True), keep_kv=True)
    while engine.has_unfinished():
        engine.step()
    payloads = engine.export_kv(rid)
    engine.pop_completion(rid)
    return payloads


def run_all(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


PROMPT = list(range(3, 45))  # 42 tokens: 5 full blocks of 8, the last token's block recomputed
OTHER = list(range(100, 120))


def test_steps_run_while_an_import_is_written_and_the_result_is_add_requests(cfg, source):
    payloads = exported(source, PROMPT)
    expected = source.generate([PROMPT, OTHER], GREEDY)
    engine = LLMEngine(cfg)
    free_before = engine.block_pool.num_free
    other = engine.add_request(OTHER, GREEDY)
    engine.step()
    pending = engine.begin_import(PROMPT, GREEDY, "imported", payloads)
    assert "imported" not in engine.seqs and len(pending.entries) == 5
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request([1, 2, 3], GREEDY, request_id="imported")
    writer = threading.Thread(target=pending.write, args=(engine.kv_cache, engine.namespace))
    writer.start()
    for _ in range(3):  # the running request keeps stepping while the bytes go in
        engine.step()
    writer.join()
    assert len(engine.seqs[other].output_token_ids) == 3 and pending.num_good == 5  # 20 tokens: 2 chunks
    assert engine.finish_import(pending) == "imported"
    run_all(engine)
    done = [engine.pop_completion(r) for r in ("imported", other)]
    assert [d.token_ids for d in done] == [e.token_ids for e in expected]
    assert done[0].num_cached_tokens == 5 * cfg.block_size
    assert engine.block_pool.num_used == 0 and free_before == engine.block_pool.num_free


def test_a_bad_block_keeps_the_good_prefix_and_a_cancel_frees_everything(cfg, source):
    payloads = exported(source, PROMPT)
    bad = bytearray(payloads[3].to_bytes())
    bad[-1] ^= 0xFF
    payloads[3] = type(payloads[3]).from_bytes(bytes(bad))
    engine = LLMEngine(cfg)
    pending = engine.begin_import(PROMPT, GREEDY, "a", payloads)
    assert pending.write(engine.kv_cache, engine.namespace) == 3
    engine.finish_import(pending)
    run_all(engine)
    done = engine.pop_completion("a")
    assert done.num_cached_tokens == 3 * cfg.block_size
    assert done.token_ids == source.generate([PROMPT], GREEDY)[0].token_ids

    free_before = engine.block_pool.num_free
    for write_first in (False, True):
        pending = engine.begin_import(PROMPT, GREEDY, "b", exported(source, PROMPT))
        assert engine.block_pool.num_free < free_before
        if write_first:
            pending.write(engine.kv_cache, engine.namespace)
        engine.cancel_import(pending)
        assert engine.block_pool.num_free == free_before and not engine.has_unfinished()
        engine.add_request([1, 2, 3], GREEDY, request_id="b")  # the id is free again
        engine.abort("b")


def test_a_device_failure_during_an_import_gives_back_its_blocks(cfg, source, monkeypatch):
    """Not a bad payload but the device failing the copy (out of memory on a GPU): add_request raises it,
    and the blocks it reserved and the request id are free again."""
    payloads = exported(source, PROMPT)
    engine = LLMEngine(cfg)
    free_before = engine.block_pool.num_free

    def out_of_memory(*_args):
        raise RuntimeError("CUDA out of memory (as a test raises it)")
    monkeypatch.setattr(engine.kv_cache, "import_block", out_of_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.add_request(PROMPT, GREEDY, request_id="a", kv_payloads=payloads)
    assert engine.block_pool.num_free == free_before and not engine.has_unfinished()
    monkeypatch.undo()
    engine.add_request(PROMPT, GREEDY, request_id="a", kv_payloads=payloads)  # the id is free again
    run_all(engine)
    assert engine.pop_completion("a").num_cached_tokens == len(payloads) * cfg.block_size


def test_pinned_blocks_outlive_an_abort_until_released(cfg):
    engine = LLMEngine(cfg)
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=1, ignore_eos=True), keep_kv=True)
    run_all(engine)
    before = engine.export_kv(rid)
    blocks = engine.pin_blocks(rid, 1, 10)  # past the full blocks: only those there are
    assert [h for _, h in blocks] == [p.block_hash for p in before[1:]]
    engine.abort(rid)
    held = [b for b, _ in blocks]
    assert all(engine.block_pool.ref_counts[b] == 1 for b in held)
    assert engine.block_pool.num_free == engine.block_pool.num_blocks - len(held) and not set(held) & set(engine.block_pool.free)
    everything_else = engine.block_pool.allocate(engine.block_pool.num_free)  # a pinned block is never handed out
    assert not set(held) & set(everything_else) and engine.block_pool.allocate(1) is None
    assert [p.data.tobytes() for p in engine.export_blocks(blocks)] == [p.data.tobytes() for p in before[1:]]
    engine.block_pool.release(everything_else + held)
    assert engine.block_pool.num_used == 0


def slow_writes(monkeypatch) -> threading.Event:
    """Writes of imported KV wait for the returned event (so a test can act while one is in progress)."""
    go = threading.Event()
    write = PendingImport.write

    def waiting(self, *args):
        assert go.wait(30)
        return write(self, *args)
    monkeypatch.setattr(PendingImport, "write", waiting)
    return go


def test_the_engine_loop_imports_on_its_kv_thread_while_streams_step(cfg, source, monkeypatch):
    payloads = exported(source, PROMPT)
    expected = source.generate([PROMPT], GREEDY)[0].token_ids
    engine = LLMEngine(cfg)
    tokens: dict[str, list[int]] = {}

    async def on_outputs(outputs):
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    async def on_failed(ids, error, is_invalid=False):
        raise AssertionError(error)

    async def run():
        loop = EngineLoop(engine, on_outputs, on_failed)
        loop.start()
        try:
            go = slow_writes(monkeypatch)
            await loop.call(engine.add_request, OTHER, SamplingParams(max_tokens=600, ignore_eos=True), "stream")
            admit = asyncio.create_task(loop.add_request_with_kv(PROMPT, GREEDY, "imported", payloads))
            await asyncio.sleep(0.05)
            seen = len(tokens.get("stream", []))
            await asyncio.sleep(0.3)
            assert len(tokens["stream"]) > seen  # the stream stepped while the import waited
            go.set()
            assert await asyncio.wait_for(admit, 30) == len(payloads)  # every block entered, none recomputed
            while len(tokens.get("imported", [])) < GREEDY.max_tokens:
                await asyncio.sleep(0.01)
            assert tokens["imported"] == expected
            await loop.call(engine.abort, "stream")

            # Cancelled during its write: its blocks come back once the write is done, not before.
            go.clear()
            used = engine.block_pool.num_used
            admit = asyncio.create_task(loop.add_request_with_kv(PROMPT, GREEDY, "cancelled", payloads))
            await asyncio.sleep(0.1)
            assert engine.block_pool.num_used > used
            admit.cancel()
            await asyncio.sleep(0.1)
            assert engine.block_pool.num_used > used  # still being written: still held
            go.set()
            for _ in range(300):
                if engine.block_pool.num_used <= used:
                    break
                await asyncio.sleep(0.01)
            assert engine.block_pool.num_used <= used and "cancelled" not in engine.seqs
        finally:
            await loop.stop()

    asyncio.run(asyncio.wait_for(run(), 60))

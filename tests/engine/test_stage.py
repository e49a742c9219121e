"""Chunked pipeline parallelism in the engine (mooncake/engine/stage.py): a prompt's layers split over 2
and 3 engines, chunks flowing through them with only hidden states (as bytes) crossing, gives the first
token one engine gives, and the stages' layers of the KV, imported by a decode engine, continue the
stream token for token as one engine does. On the tiny model, the emulated one and the real SmolLM2."""

import dataclasses

import pytest
import torch

from mooncake.config import EngineConfig
from mooncake.engine import LLMEngine, SamplingParams
from mooncake.engine.stage import PipelineStage, StageChunk, stage_layers
from mooncake.errors import InvalidRequestError, KVPayloadError, ModelError
from mooncake.hidden_payload import decode_hidden, encode_hidden
from tests.conftest import REAL, TINY
from tests.cpp_harness import run_local_pipeline

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


# NOTE: SmolLM2's pipelines run in the slow tier (about 35 s of make test): the tiny and emulated models cover
# every path here, and SmolLM2's parity with transformers is checked in make test by test_parity.py.
@pytest.fixture(scope="module", params=[TINY, "emulated-llama3-70b",
                                        pytest.param(REAL, marks=[pytest.mark.real_model, pytest.mark.slow])])
def cfg(request):
    from mooncake.models.fetch import fetch_model
    path = fetch_model(request.param)
    return EngineConfig(model=str(path), block_size=16, prefill_chunk=24, num_kv_blocks=128, emulation_speedup=1000)


@pytest.fixture(scope="module")
def single(cfg):
    return LLMEngine(cfg)


def prompt(engine, n=70):
    words = "Mooncake splits a long prompt into chunks and layers and streams them through a group of nodes. "
    return engine.tokenizer(words * 8)["input_ids"][:n]


def computed_blocks(cfg, ids) -> list:
    """The prompt's full blocks, whole, as an engine that computed it exports them (to decode, the pool)."""
    writer = LLMEngine(cfg)
    writer.add_request(ids, SamplingParams(max_tokens=1), "w", (), True)
    while writer.has_unfinished():
        writer.step()
    return [type(p).from_bytes(p.to_bytes()) for p in writer.export_kv("w")]


def decode_with(cfg, ids, payloads):
    """The completion a decode engine gives the prompt from these payloads (as they cross the wire)."""
    decode = LLMEngine(cfg)
    rid = decode.add_request(ids, GREEDY, kv_payloads=[type(p).from_bytes(p.to_bytes()) for p in payloads])
    while decode.has_unfinished():
        decode.step()
    return decode.pop_completion(rid)


def test_layers_split_evenly_and_bad_splits_are_refused():
    assert stage_layers(30, 2) == [range(0, 15), range(15, 30)]
    assert stage_layers(30, 4) == [range(0, 7), range(7, 15), range(15, 22), range(22, 30)]
    assert stage_layers(4, 3) == [range(0, 1), range(1, 2), range(2, 4)]
    with pytest.raises(InvalidRequestError, match="5 pipeline stages"):
        stage_layers(4, 5)


def test_hidden_states_cross_as_bytes_and_a_changed_byte_is_caught():
    hidden = torch.randn(7, 12)
    data = encode_hidden(hidden)
    assert torch.equal(decode_hidden(data), hidden)
    assert torch.equal(decode_hidden(encode_hidden(torch.arange(5))), torch.arange(5))
    for at in (0, 5, 14, len(data) // 2, len(data) - 1):
        bad = bytearray(data)
        bad[at] ^= 0x10
        with pytest.raises(KVPayloadError):
            decode_hidden(bytes(bad))
    with pytest.raises(RuntimeError) as failed:  # the device's failure is not called a corrupt payload
        decode_hidden(data, "no-such-device")
    assert not isinstance(failed.value, KVPayloadError)


@pytest.mark.parametrize("stages", [2, 3])
def test_a_pipeline_gives_one_engines_tokens(cfg, single, stages):
    ids = prompt(single)
    (alone,) = single.generate([ids], GREEDY)
    num_layers = single.runner.kv_spec.num_layers
    group = [PipelineStage(LLMEngine(cfg), layers) for layers in stage_layers(num_layers, stages)]
    free = [s.engine.block_pool.num_free for s in group]
    logits = run_local_pipeline(group, "r1", ids, chunk_tokens=cfg.prefill_chunk)
    assert logits.shape == (1, single.runner.vocab_size)
    assert int(logits.argmax()) == alone.token_ids[0]  # the first token, from the last stage

    payloads = [p for stage in group for p in stage.export("r1")]
    assert sorted({p.layer for p in payloads}) == list(range(num_layers))  # every layer, from its stage
    first = group[0]  # a push of blocks [1, 3) as a chunk filled them: those blocks alone, each layer once
    part = first.export("r1", 1, 3)
    assert [(p.block_hash, p.layer) for p in part] == [(h, layer) for h in first.jobs["r1"].hashes[1:3]
                                                       for layer in first.layers]
    for stage, before in zip(group, free):
        hashes = stage.jobs["r1"].hashes
        assert stage.engine.block_pool.match_prefix(hashes) == []  # a stage's partial blocks are never a cache hit
        stage.end("r1")
        assert stage.engine.block_pool.num_free == before
    out = decode_with(cfg, ids, payloads)
    assert out.num_cached_tokens == (len(ids) - 1) // cfg.block_size * cfg.block_size  # the stages' KV was used
    assert out.token_ids == alone.token_ids


def test_a_group_runs_a_prompt_too_long_for_one_engines_cache(cfg, single):
    """A stage keeps only its layers, several of its blocks in one of its engine's: two stages, each
    with a cache too small for the prompt on one engine, give one engine's first token, and their KV
    continues the stream on decode token for token."""
    ids = prompt(single, 150)  # 10 blocks of 16
    (alone,) = single.generate([ids], GREEDY)
    small = dataclasses.replace(cfg, num_kv_blocks=6)
    with pytest.raises(InvalidRequestError, match="needs 10 KV blocks"):
        LLMEngine(small).add_request(ids, GREEDY)
    num_layers = single.runner.kv_spec.num_layers
    group = [PipelineStage(LLMEngine(small), layers) for layers in stage_layers(num_layers, 2)]
    logits = run_local_pipeline(group, "r1", ids, chunk_tokens=cfg.prefill_chunk)
    assert int(logits.argmax()) == alone.token_ids[0]
    for stage in group:
        assert stage.engine.block_pool.num_free == 6 - -(-10 // stage.view.per_block)
    payloads = [p for stage in group for p in stage.export("r1")]
    for stage in group:
        stage.end("r1")
        assert stage.engine.block_pool.num_free == 6
    out = decode_with(cfg, ids, payloads)
    assert out.num_cached_tokens == 9 * cfg.block_size and out.token_ids == alone.token_ids


@pytest.mark.parametrize("reused", [3, 4])
def test_a_group_reuses_a_cached_prefix_and_computes_only_the_rest(cfg, single, reused):
    """Whole blocks of the prompt's prefix, as the cache pool serves them, given to every stage's `begin`:
    each copies its layers in and computes only the rest, and the first token and decode's stream are one
    engine's (4 blocks: all the full ones before the prompt's last token)."""
    ids = prompt(single, 70)
    (alone,) = single.generate([ids], GREEDY)
    pool = computed_blocks(cfg, ids)[:reused]  # as the instance that computed them wrote them to the pool
    num_layers = single.runner.kv_spec.num_layers
    group = [PipelineStage(LLMEngine(cfg), layers) for layers in stage_layers(num_layers, 2)]
    computed = []
    for stage in group:
        run = stage.run
        stage.run = lambda rid, n, hidden, since=None, run=run: computed.append(n) or run(rid, n, hidden, since)
    logits = run_local_pipeline(group, "r1", ids, chunk_tokens=16, prefix=pool)
    assert int(logits.argmax()) == alone.token_ids[0]
    assert sum(computed) == 2 * (len(ids) - reused * cfg.block_size)  # each stage computed the rest alone
    payloads = [p for stage in group for p in stage.export("r1")]
    out = decode_with(cfg, ids, payloads)
    assert out.num_cached_tokens == 4 * cfg.block_size and out.token_ids == alone.token_ids


def test_a_stage_refuses_a_prefix_that_is_not_the_prompts(cfg, single):
    engine = LLMEngine(cfg)
    stage = PipelineStage(engine, range(0, 1))
    ids = prompt(single, 40)  # 2 full blocks, both reusable
    blocks = computed_blocks(cfg, ids)
    with pytest.raises(KVPayloadError, match="not the prompt's block"):
        stage.begin("r1", ids, [blocks[1]])
    flipped = bytearray(blocks[0].to_bytes())
    flipped[-1] ^= 0x01
    corrupt = type(blocks[0]).from_bytes(bytes(flipped))
    with pytest.raises(KVPayloadError, match="fail their MAC"):
        stage.begin("r1", ids, [corrupt])
    with pytest.raises(InvalidRequestError, match="at most 1 blocks"):
        stage.begin("r1", ids[:32], blocks)  # 32 tokens: the second block holds the last token
    assert engine.block_pool.num_free == cfg.num_kv_blocks and not stage.jobs  # nothing held


def test_a_device_failure_while_a_stage_copies_its_prefix_in_holds_nothing(cfg, single, monkeypatch):
    engine = LLMEngine(cfg)
    stage = PipelineStage(engine, range(0, 1))
    ids = prompt(single, 40)

    def out_of_memory(*_args):
        raise RuntimeError("CUDA out of memory (as a test raises it)")
    monkeypatch.setattr(engine.kv_cache, "import_stage_block", out_of_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        stage.begin("r1", ids, computed_blocks(cfg, ids)[:1])
    assert engine.block_pool.num_free == cfg.num_kv_blocks and not stage.jobs


def test_a_stage_refuses_what_it_cannot_run(cfg, single):
    engine = LLMEngine(cfg)
    num_layers = engine.runner.kv_spec.num_layers
    with pytest.raises(InvalidRequestError, match="outside"):
        PipelineStage(engine, range(0, num_layers + 1))
    later = PipelineStage(engine, range(1, num_layers))
    later.begin("r1", prompt(single, 20))
    with pytest.raises(ModelError, match="hidden states"):
        later.run("r1", 8, None)  # a later stage needs the previous stage's output
    with pytest.raises(InvalidRequestError, match="already"):
        later.begin("r1", [1, 2, 3])
    later.end("r1")
    with pytest.raises(InvalidRequestError, match="no room"):
        later.begin("r2", [5] * (cfg.num_kv_blocks * cfg.block_size + 10))
    assert engine.block_pool.num_free == cfg.num_kv_blocks  # nothing held


def test_a_failed_stage_ends_the_pipeline_with_its_error(cfg, single):
    num_layers = single.runner.kv_spec.num_layers
    group = [PipelineStage(LLMEngine(cfg), layers) for layers in stage_layers(num_layers, 2)]

    def broken(*args):
        raise RuntimeError("stage 0 lost its device")
    group[0].run = broken
    with pytest.raises(RuntimeError, match="lost its device"):
        run_local_pipeline(group, "r1", prompt(single), chunk_tokens=16, timeout_s=30)


def test_a_chunk_through_the_engines_scheduler_gives_what_run_gives_in_budget_sized_steps(cfg, single):
    """In an instance a stage's chunk takes steps of its engine (`submit`, `Scheduler.stage_turn`): a chunk
    longer than the step's token budget takes several, and gives what one `run` of it gives."""
    ids = prompt(single, 40)
    layers = stage_layers(single.runner.kv_spec.num_layers, 2)
    direct = [PipelineStage(LLMEngine(cfg), r) for r in layers]
    small = dataclasses.replace(cfg, max_num_batched_tokens=16, max_num_seqs=4)
    stepped = [PipelineStage(LLMEngine(small), r) for r in layers]
    for stage in direct + stepped:
        stage.begin("r1", ids)
    hidden = direct[0].run("r1", 40, None)
    logits = direct[1].run("r1", 40, hidden)
    results = []
    for stage, given in zip(stepped, (None, hidden)):
        chunk = StageChunk(stage, "r1", 40, given)
        stage.submit(chunk)
        steps = 0
        while stage.engine.has_unfinished():
            assert stage.engine.step() == []
            steps += 1
        assert steps == 3 and stage.engine.scheduler.drain_stage_chunks() == [chunk]  # 16 + 16 + 8 tokens
        assert chunk.error is None and stage.jobs["r1"].done == 40
        # an emulated device is its engine's: the engine's next work starts after the chunk's modelled end
        assert stage.engine.modelled_end == (stage.jobs["r1"].modelled_end if stage.engine.runner.modelled else 0.0)
        results.append(chunk.result)
    torch.testing.assert_close(results[0], hidden, atol=1e-4, rtol=1e-4)
    assert results[1].shape == (1, single.runner.vocab_size)
    torch.testing.assert_close(results[1], logits, atol=1e-4, rtol=1e-4)


def test_a_stage_refuses_a_chunk_it_cannot_run_and_fails_those_queued_when_its_request_ends(cfg, single):
    engine = LLMEngine(cfg)
    stage = PipelineStage(engine, range(0, 1))
    ids = prompt(single, 20)
    with pytest.raises(InvalidRequestError, match="not in this stage"):
        stage.submit(StageChunk(stage, "r1", 8, None))
    stage.begin("r1", ids)
    stage.submit(StageChunk(stage, "r1", 16, None))
    with pytest.raises(InvalidRequestError, match="4 of its prompt left"):  # 20 tokens, 16 queued already
        stage.submit(StageChunk(stage, "r1", 8, None))
    with pytest.raises(InvalidRequestError, match="a chunk of 0 tokens"):
        stage.submit(StageChunk(stage, "r1", 0, None))
    stage.end("r1")  # before any step: its queued chunk fails, its blocks are free
    (failed,) = engine.scheduler.drain_stage_chunks()
    assert isinstance(failed.error, InvalidRequestError) and "left the stage" in str(failed.error)
    assert not engine.has_unfinished() and engine.block_pool.num_free == cfg.num_kv_blocks


def test_a_chunk_that_fails_fails_alone_and_the_engine_steps_on(cfg, single, monkeypatch):
    engine = LLMEngine(cfg)
    stage = PipelineStage(engine, range(0, 1))
    stage.begin("r1", prompt(single, 20))
    engine.add_request(prompt(single, 20), SamplingParams(max_tokens=2), "other")

    def lost(*_args):
        raise RuntimeError("the stage lost its device")
    monkeypatch.setattr(stage, "run", lost)
    chunk = StageChunk(stage, "r1", 20, None)
    stage.submit(chunk)
    outputs = []
    for _ in range(10):
        outputs += engine.step()
    (failed,) = engine.scheduler.drain_stage_chunks()
    assert failed is chunk and "lost its device" in str(chunk.error) and chunk.result is None
    assert not engine.scheduler.stage_chunks and stage.jobs["r1"].done == 0
    assert [o.finished for o in outputs if o.request_id == "other"][-1]  # the engine's own request went on

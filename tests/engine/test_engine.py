"""Engine behaviour on the tiny model and on the emulated one (the same contract, no numeric parity):
stopping, validation, abort, preemption, sampling, bad imports."""

import pytest

from mooncake.config import EngineConfig
from mooncake.engine import LLMEngine, SamplingParams
from mooncake.errors import InvalidRequestError
from tests.conftest import hf_reference

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(cfg):
    return LLMEngine(cfg)


def ids_of(engine, text):
    return engine.tokenizer(text)["input_ids"]


def test_max_tokens_and_stop_token_ids(engine):
    ids = ids_of(engine, "hello there")
    (full,) = engine.generate([ids], GREEDY)
    assert len(full.token_ids) == 24 and full.finish_reason == "length"
    stop_at = full.token_ids[5]
    (cut,) = engine.generate([ids], SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(stop_at,)))
    first = full.token_ids.index(stop_at)
    assert cut.token_ids == full.token_ids[:first + 1] and cut.finish_reason == "stop"


def test_eos_stops_unless_ignored(engine):
    ids = ids_of(engine, "hello there")
    (full,) = engine.generate([ids], GREEDY)
    eos = full.token_ids[3]
    engine.runner.eos_token_ids = (eos,)
    try:
        (out,) = engine.generate([ids], SamplingParams(max_tokens=24))
    finally:
        engine.runner.eos_token_ids = ()
    assert out.token_ids == full.token_ids[:full.token_ids.index(eos) + 1] and out.finish_reason == "stop"


def test_stop_string(engine):
    ids = ids_of(engine, "abc")
    (full,) = engine.generate([ids], GREEDY)
    text = engine.tokenizer.decode(full.token_ids[4:6])
    (out,) = engine.generate([ids], SamplingParams(max_tokens=24, ignore_eos=True, stop=(text,)))
    assert out.finish_reason == "stop" and len(out.token_ids) <= 6
    assert text in engine.tokenizer.decode(out.token_ids)


@pytest.mark.parametrize("short_of_context, max_tokens, match", [
    (None, 4, "empty"),
    (0, 1, "context length"),
    (96, 200, "exceeds the context length"),
])
def test_requests_over_the_context_are_rejected(engine, short_of_context, max_tokens, match):
    prompt_len = 0 if short_of_context is None else engine.max_model_len - short_of_context
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request([1] * prompt_len, SamplingParams(max_tokens=max_tokens))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"max_tokens": -3}, {"temperature": -1},
                                    {"top_p": 0}, {"top_k": -1}, {"stop": ("",)}])
def test_bad_sampling_params(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_out_of_vocab_ids_and_duplicate_request_ids_are_rejected(engine):
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request([10_000])
    engine.add_request([1, 2, 3], request_id="dup")
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request([1, 2, 3], request_id="dup")
    engine.abort("dup")


def test_abort_frees_every_block(engine):
    free_before = engine.block_pool.num_free
    rid = engine.add_request(ids_of(engine, "x" * 40), GREEDY)
    engine.step()
    engine.step()
    assert engine.block_pool.num_free < free_before
    engine.abort(rid)
    assert engine.block_pool.num_free == free_before and not engine.has_unfinished()


def test_preemption_under_a_tiny_cache_keeps_outputs_exact(tiny_dir, cfg):
    small = LLMEngine(EngineConfig(model=cfg.model, block_size=8, prefill_chunk=16, num_kv_blocks=12,
                                   emulation_speedup=cfg.emulation_speedup))
    prompts = [ids_of(small, f"story number {i}: once upon a time") for i in range(4)]
    rids = [small.add_request(p, GREEDY) for p in prompts]
    seqs = [small.seqs[r] for r in rids]
    while small.has_unfinished():
        small.step()
    assert sum(s.num_preemptions for s in seqs) > 0  # 4 x 6 blocks needed, 12 in the pool
    outs = [small.pop_completion(r) for r in rids]
    if cfg.model == str(tiny_dir):
        hf = hf_reference(tiny_dir)
        assert [out.token_ids for out in outs] == [hf.greedy(ids, 24) for ids in prompts]
    else:  # no numeric reference: the same engine with room for everything
        assert [out.token_ids for out in outs] == [o.token_ids for o in LLMEngine(cfg).generate(prompts, GREEDY)]
    assert small.block_pool.num_free == 12


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    ids = ids_of(engine, "sample me")
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    (alone,) = engine.generate([ids], params)
    batch = engine.generate([ids_of(engine, "other"), ids, ids_of(engine, "third one")], params)
    assert batch[1].token_ids == alone.token_ids
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=43, ignore_eos=True)
    assert engine.generate([ids], other_seed)[0].token_ids != alone.token_ids


def test_top_k_one_is_greedy(engine):
    ids = ids_of(engine, "top k")
    (greedy,) = engine.generate([ids], GREEDY)
    (k1,) = engine.generate([ids], SamplingParams(max_tokens=24, temperature=0.7, top_k=1, seed=1,
                                                   ignore_eos=True))
    assert k1.token_ids == greedy.token_ids


def test_corrupted_import_is_a_miss_and_output_stays_exact(engine, cfg):
    ids = ids_of(engine, "z" * 50)
    rid = engine.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True), keep_kv=True)
    while engine.has_unfinished():
        engine.step()
    payloads = engine.export_kv(rid)
    engine.pop_completion(rid)
    assert len(payloads) == 6
    bad = bytearray(payloads[2].to_bytes())
    bad[-1] ^= 0xFF
    payloads[2] = type(payloads[2]).from_bytes(bytes(bad))
    other = LLMEngine(cfg)
    rid = other.add_request(ids, GREEDY, kv_payloads=payloads)
    while other.has_unfinished():
        other.step()
    out = other.pop_completion(rid)
    assert out.num_cached_tokens == 2 * cfg.block_size  # blocks 0 and 1 imported; the chain stops at 2
    assert out.token_ids == engine.generate([ids], GREEDY)[0].token_ids


def test_decodes_of_far_apart_lengths_attend_in_groups_and_match_each_alone(engine):
    vocab = engine.runner.vocab_size
    prompts = [[(7 * i) % (vocab - 2) + 1 for i in range(n)] for n in (700, 650, 300, 12)]
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == alone


def test_decode_rows_are_grouped_by_length_within_the_padding_allowance():
    from mooncake.engine.batch import _by_length
    assert _by_length([1000, 900, 300, 20]) == [(0, 2), (2, 3), (3, 4)]  # 1000 pads 900 by 10%; 300 is far
    assert _by_length([200, 10, 1]) == [(0, 3)]  # short contexts batch whole
    assert _by_length([]) == []

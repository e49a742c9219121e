"""Greedy token ids must equal transformers' generate(do_sample=False) on the same float32 weights, for
64 new tokens, on the tiny random model and on the real SmolLM2: (a) a fresh prompt, (b) a prompt whose
prefix comes from the local cache, (c) KV exported after prefill and imported into a second engine,
(d) 8 prompts decoded together with continuous batching, half of them joining mid-way. And (e) the
log-probabilities the engine reports equal transformers' over the same tokens, (f) over the prompt too; (g) the
same without each compiled kernel."""

import random

import pytest

from mooncake.config import EngineConfig
from mooncake.engine import LLMEngine, SamplingParams
from tests.conftest import REAL, TINY, hf_reference

NEW_TOKENS = 64
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
TEXTS = [
    "The history of the printing press begins in",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Photosynthesis is the process by which plants",
    "Here is a list of the planets of the solar system, in order from the sun:",
    "Once upon a time, in a village at the edge of a great forest, there lived",
    "The three most important rules of writing clear code are",
    "Q: Why is the sky blue?\nA:",
    "Mooncake is a serving system that",
]
SHARED = ("You are a careful assistant. Answer with facts only, cite no sources, and keep every answer "
          "short and precise. The user asks about geography, history and science. ") * 3


@pytest.fixture(scope="module", params=[TINY, pytest.param(REAL, marks=pytest.mark.real_model)])
def setup(request):
    from mooncake.models.fetch import fetch_model
    path = fetch_model(request.param)
    # Small blocks and chunks so prompts of a few dozen tokens span several blocks and chunks.
    block_size, chunk = (16, 24) if request.param == TINY else (32, 48)
    cfg = EngineConfig(model=str(path), block_size=block_size, prefill_chunk=chunk, num_kv_blocks=512)
    return cfg, LLMEngine(cfg), hf_reference(path)


def prompts(engine, n, prefix=""):
    tok = engine.tokenizer
    return [tok(prefix + t)["input_ids"] for t in (TEXTS * 2)[:n]]


def run_to_end(engine, request_ids):
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_completion(r) for r in request_ids]


def test_a_fresh_prompt(setup):
    cfg, engine, hf = setup
    (ids,) = prompts(engine, 1)
    (out,) = engine.generate([ids], GREEDY)
    assert out.token_ids == hf.greedy(ids, NEW_TOKENS)
    assert out.finish_reason == "length"


def test_b_prefix_reused_from_local_cache(setup):
    cfg, engine, hf = setup
    first, second = prompts(engine, 2, prefix=SHARED)
    engine.generate([first], SamplingParams(max_tokens=1))
    (out,) = engine.generate([second], GREEDY)
    shared_tokens = len(engine.tokenizer(SHARED)["input_ids"])
    assert out.num_cached_tokens >= (shared_tokens // cfg.block_size - 1) * cfg.block_size > 0
    assert out.token_ids == hf.greedy(second, NEW_TOKENS)


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole-blocks", "layer-by-layer"])
def test_c_exported_after_prefill_and_decoded_elsewhere(setup, layerwise):
    cfg, engine, hf = setup
    (ids,) = prompts(engine, 1, prefix=SHARED)
    # Prefill only: one token, and the KV is kept after finishing until it has been exported.
    rid = engine.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True), keep_kv=True)
    while engine.has_unfinished():
        engine.step()
    if layerwise:
        num_layers = engine.runner.kv_spec.num_layers
        payloads = [p for layer in range(num_layers) for p in engine.export_kv(rid, layer=layer)]
    else:
        payloads = engine.export_kv(rid)
    free_before = engine.block_pool.num_free
    engine.pop_completion(rid)
    assert engine.block_pool.num_free > free_before
    assert len(payloads) >= 2

    decoder = LLMEngine(cfg)  # a second engine with an empty cache
    wire = [type(p).from_bytes(p.to_bytes()) for p in payloads]  # as they would cross the network
    rid = decoder.add_request(ids, GREEDY, kv_payloads=wire)
    (out,) = run_to_end(decoder, [rid])
    num_blocks = len({p.block_hash for p in payloads})
    assert num_blocks == len(ids) // cfg.block_size  # every full block of the prompt was exported
    assert out.num_cached_tokens == min(num_blocks, (len(ids) - 1) // cfg.block_size) * cfg.block_size
    assert out.token_ids == hf.greedy(ids, NEW_TOKENS)


@pytest.mark.slow  # the longest parity run
def test_d_continuous_batching_with_requests_joining_midway(setup):
    cfg, engine, hf = setup
    all_ids = prompts(engine, 8)
    rng = random.Random(0)
    first = [engine.add_request(ids, GREEDY) for ids in all_ids[:4]]
    for _ in range(5):
        engine.step()
    late = []
    for ids in all_ids[4:]:
        late.append(engine.add_request(ids, GREEDY))
        for _ in range(rng.randint(1, 3)):
            engine.step()
    outs = run_to_end(engine, first + late)
    for ids, out in zip(all_ids, outs):
        assert out.token_ids == hf.greedy(ids, NEW_TOKENS)


def test_e_logprobs_are_the_models_raw_distribution(setup):
    cfg, engine, hf = setup
    plain, greedy_ids, sampled_ids = prompts(engine, 3)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)
    sampled = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5, temperature=0.9, seed=3)
    rids = [engine.add_request(plain, SamplingParams(max_tokens=12, ignore_eos=True)),
            engine.add_request(greedy_ids, greedy), engine.add_request(sampled_ids, sampled)]
    none, *asked = run_to_end(engine, rids)
    assert none.logprobs is None
    tol = 2e-3
    for ids, out, want in zip((greedy_ids, sampled_ids), asked, (3, 5)):
        ref = hf.logprobs(ids, out.token_ids)
        assert len(out.logprobs) == len(out.token_ids) == 12
        for row, token, lp in zip(ref, out.token_ids, out.logprobs):
            assert lp.logprob == pytest.approx(row[token].item(), abs=tol)
            top = row.topk(want)
            assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=tol)
            assert all(row[t].item() == pytest.approx(v, abs=tol) for t, v in lp.top)
    greedy_out = asked[0]
    assert all(lp.top[0][0] == t for t, lp in zip(greedy_out.token_ids, greedy_out.logprobs))  # greedy: the likeliest


def test_f_prompt_logprobs_are_the_models_over_every_prompt_token(setup):
    """A prompt over several chunks, whose blocks the prefix cache holds (they are computed anyway: cached
    tokens have no logits), batched with a request that decodes meanwhile."""
    cfg, engine, hf = setup
    first, ids = prompts(engine, 2, prefix=SHARED)
    engine.generate([ids], SamplingParams(max_tokens=1))  # its blocks are in the prefix cache now
    busy = engine.add_request(first, SamplingParams(max_tokens=24, ignore_eos=True))
    engine.step()
    rid = engine.add_request(ids, SamplingParams(max_tokens=3, ignore_eos=True, logprobs=1, prompt_logprobs=4))
    busy_out, out = run_to_end(engine, [busy, rid])
    assert len(ids) > 2 * cfg.prefill_chunk and out.num_cached_tokens == 0
    assert busy_out.prompt_logprobs is None and len(busy_out.token_ids) == 24
    ref = hf.logprobs(ids[:1], ids[1:])  # the distribution of each prompt token after the first
    assert len(out.prompt_logprobs) == len(ids) - 1
    tol = 2e-3
    for row, token, lp in zip(ref, ids[1:], out.prompt_logprobs):
        assert lp.logprob == pytest.approx(row[token].item(), abs=tol)
        assert row.topk(lp.rank).values[-1].item() == pytest.approx(row[token].item(), abs=tol)  # its rank
        # NOTE: its top 4 are transformers' top 4, in order up to near-ties (a random model's logits tie
        # within 1e-5, where float32 rounding decides the order)
        assert [row[t].item() for t, _ in lp.top] == pytest.approx(row.topk(4).values.tolist(), abs=1e-4)
        assert [v for _, v in lp.top] == pytest.approx(row.topk(4).values.tolist(), abs=tol)
    assert out.token_ids == hf.greedy(ids, 3)  # the answer is as without prompt logprobs


@pytest.mark.parametrize("kernel", ["paged", "fused"])
def test_g_each_compiled_kernel_can_be_done_without(setup, kernel):
    """The compiled kernels (backends/kernels/: paged decode attention, the fused layer ops) serve on a CPU in
    float32 wherever they can be built; without one (no compiler, or another device or dtype) decode gathers
    K and V for SDPA, or the layers run torch's operations. Either way the model gives transformers' tokens,
    prefill and decode, for a batch of prompts whose lengths differ."""
    from backends.kernels import fused_ops, paged_attention
    cfg, engine, hf = setup
    loaded = getattr(engine.runner, kernel)
    assert (loaded is None) == ({"paged": paged_attention, "fused": fused_ops}[kernel].load() is None)
    all_ids = prompts(engine, 3, prefix=SHARED)[:1] + prompts(engine, 2)
    setattr(engine.runner, kernel, None)
    try:
        outs = engine.generate(all_ids, SamplingParams(max_tokens=16, ignore_eos=True))
    finally:
        setattr(engine.runner, kernel, loaded)
    for ids, out in zip(all_ids, outs):
        assert out.token_ids == hf.greedy(ids, 16)

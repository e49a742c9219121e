"""The emulated model runner (backends/models/emulated.py): it charges what the cost model says, its
streams depend on the KV that lies in the cache, and a prefix hit or a KV hand-off leaves the stream as
it is, as with the real runner. (The engine's contract tests run on it too: tests/engine/test_engine.py.)"""

import dataclasses
import tomllib

import numpy as np
import pytest

from mooncake.answer_lengths import ANSWER_ALPHABET, AnswerLengths, answer_token_ids
from mooncake.config import EngineConfig, SimConfig
from mooncake.cost import CostModel
from mooncake.engine import LLMEngine, SamplingParams
from mooncake.kv_mac import data_mac
from mooncake.models.catalog import CATALOG
from mooncake.sim.run import sim_cost

NAME = "emulated-llama3-70b"
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def cfg():
    from mooncake.models.fetch import fetch_model
    return EngineConfig(model=str(fetch_model(NAME)), block_size=16, prefill_chunk=64, num_kv_blocks=512,
                        emulation_speedup=1000)


def run(engine, ids, params=GREEDY, **kwargs):
    rid = engine.add_request(ids, params, **kwargs)
    modelled = 0.0
    while engine.has_unfinished():
        engine.step()
        modelled += engine.last_modelled_s * engine.runner.modelled.speedup
    return engine.pop_completion(rid), modelled


def test_under_the_additive_step_model_it_charges_eq_1_for_the_uncached_prompt_and_a_decode_step_per_token(cfg):
    engine = LLMEngine(dataclasses.replace(cfg, emulation_step_model="additive"))
    cost = engine.runner.modelled.cost
    prompt = list(range(3, 203))  # 200 tokens: four chunks of 64 and one of 8
    out, modelled = run(engine, prompt, SamplingParams(max_tokens=1))
    assert modelled == pytest.approx(cost.prefill_s(200))  # the chunks' costs add up to the whole prompt's
    out, modelled = run(engine, prompt + [7] * 40, SamplingParams(max_tokens=3, ignore_eos=True))
    assert out.num_cached_tokens == 192  # 12 full blocks from the prefix cache
    decode = cost.decode_step_s(1, 241) + cost.decode_step_s(1, 242)
    assert modelled == pytest.approx(cost.prefill_s(240, 192) + decode)


def test_under_the_roofline_a_step_costs_its_larger_bound_and_a_mixed_step_less_than_its_parts(cfg):
    engine = LLMEngine(cfg)  # the model's own step model: roofline
    cost = engine.runner.modelled.cost
    assert cost.step_model == "roofline"
    prompt = list(range(3, 203))
    out, modelled = run(engine, prompt, SamplingParams(max_tokens=1))
    chunks = [(64, 0), (128, 64), (192, 128), (200, 192)]
    assert modelled == pytest.approx(sum(cost.step_s([c]) for c in chunks))
    assert modelled > cost.prefill_s(200)  # 64-token chunks of a 70B model are memory-bound: the weights' read
    # One running decode, then a 128-token prompt joins its steps: mixed steps cost less than apart.
    additive = LLMEngine(dataclasses.replace(cfg, emulation_step_model="additive"))
    totals = {}
    for name, each in (("roofline", engine), ("additive", additive)):
        first = each.add_request(list(range(50, 90)), SamplingParams(max_tokens=40, ignore_eos=True))
        each.step()
        each.add_request(list(range(100, 228)), SamplingParams(max_tokens=1))
        totals[name] = 0.0
        while each.has_unfinished():
            each.step()
            totals[name] += each.last_modelled_s * each.runner.modelled.speedup
        assert len(each.pop_completion(first).token_ids) == 40
    prefill = cost.prefill_s(64) + cost.prefill_s(128, 64)  # the joining prompt's two chunks, alone
    assert totals["additive"] == pytest.approx(totals["roofline"] + prefill, rel=0.02)
    assert totals["roofline"] > 39 * cost.decode_step_s(1, 42)


def test_its_cost_model_and_kv_capacity_are_the_simulators(cfg):
    spec = tomllib.loads(CATALOG[NAME].spec_path.read_text())
    sim = SimConfig()
    assert CostModel.from_dict(spec["cost"], NAME) == sim_cost(sim)
    assert spec["config"]["kv_capacity_tokens"] == sim.decode_kv_tokens
    sized = LLMEngine(EngineConfig(model=cfg.model, block_size=64, kv_cache_bytes=1 << 20))  # bytes are ignored
    assert sized.block_pool.num_blocks == sim.decode_kv_tokens // 64


def test_streams_are_deterministic_per_prompt_whatever_the_batch(cfg):
    engine = LLMEngine(cfg)
    prompts = [list(range(10 + i, 90 + i)) for i in range(3)]
    alone = [run(engine, p)[0].token_ids for p in prompts]
    together = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    assert together == alone and len({tuple(t) for t in alone}) == 3
    text = engine.tokenizer.decode(alone[0])
    assert text and set(text) <= set("etaoin shrdlucmfwypvbgkq")


def test_a_kv_hand_off_keeps_the_stream_and_other_kv_changes_it(cfg):
    prefill, decode = LLMEngine(cfg), LLMEngine(cfg)
    ids = list(range(40, 140))
    reference = run(LLMEngine(cfg), ids)[0].token_ids
    rid = prefill.add_request(ids, SamplingParams(max_tokens=1), keep_kv=True)
    while prefill.has_unfinished():
        prefill.step()
    payloads = [type(p).from_bytes(p.to_bytes()) for p in prefill.export_kv(rid)]
    prefill.pop_completion(rid)
    handed, _ = run(decode, ids, kv_payloads=payloads)
    assert handed.num_cached_tokens == 96 and handed.token_ids == reference

    # The same blocks with other (well-formed, MACed) bytes: the digest of the cache changes the stream.
    data = np.frombuffer(bytes(payloads[2].data), dtype=np.float32).copy()
    data[0] = (data[0] + 1) % 251
    forged = dataclasses.replace(payloads[2], data=data.tobytes(), mac=data_mac(data.tobytes()))
    changed, _ = run(LLMEngine(cfg), ids, kv_payloads=payloads[:2] + [forged] + payloads[3:])
    assert changed.num_cached_tokens == 96 and changed.token_ids != reference


def short_answered_prompts(lengths: AnswerLengths, count: int, ends_in_answer_tokens: bool = False):
    """Prompts (and their answer lengths) the model answers in 2-80 tokens: quick to run."""
    found, answer_ids = [], answer_token_ids()
    for i in range(10_000):
        prompt = [(i * 37 + j * 11) % 240 + 10 for j in range(50 + i % 90)]
        prompt += answer_ids[i % 5:i % 5 + 3] if ends_in_answer_tokens else [10]
        if 2 <= (n := lengths.of_prompt(prompt, answer_ids)) <= 80:
            found.append((prompt, n))
        if len(found) == count:
            return found
    raise AssertionError("no prompt with a short answer")


def test_answers_end_with_eos_at_the_length_the_simulator_computes(cfg):
    engine = LLMEngine(cfg)
    lengths = engine.runner.answers
    assert lengths is not None and engine.runner.alphabet == answer_token_ids()
    cases = short_answered_prompts(lengths, 3) + short_answered_prompts(lengths, 2, ends_in_answer_tokens=True)
    outs = engine.generate([p for p, _ in cases], SamplingParams(max_tokens=3000, temperature=0.0))
    assert [len(o.token_ids) for o in outs] == [n for _, n in cases]
    assert {o.finish_reason for o in outs} == {"stop"}
    assert all(set(engine.tokenizer.decode(o.token_ids, skip_special_tokens=True)) <= set(ANSWER_ALPHABET)
               for o in outs)
    # sampled, the tokens differ but the answer ends where it would greedily
    sampled = engine.generate([cases[0][0]], SamplingParams(max_tokens=3000, temperature=1.0, seed=3))[0]
    assert len(sampled.token_ids) == cases[0][1]
    # A cap below the answer cuts it; ignore_eos writes on past its end.
    prompt, n = cases[0]
    assert engine.generate([prompt], SamplingParams(max_tokens=n - 1))[0].finish_reason == "length"
    assert len(engine.generate([prompt], SamplingParams(max_tokens=n + 5, ignore_eos=True))[0].token_ids) == n + 5


def test_an_answer_ends_at_the_same_length_after_a_kv_hand_off_or_a_recomputed_move(cfg):
    prompt, n = short_answered_prompts(LLMEngine(cfg).runner.answers, 1)[0]
    whole = run(LLMEngine(cfg), prompt, SamplingParams(max_tokens=3000))[0].token_ids
    assert len(whole) == n
    prefill = LLMEngine(cfg)
    rid = prefill.add_request(prompt, SamplingParams(max_tokens=1), keep_kv=True)
    while prefill.has_unfinished():
        prefill.step()
    payloads = [type(p).from_bytes(p.to_bytes()) for p in prefill.export_kv(rid)]
    first = prefill.pop_completion(rid).token_ids
    # decode continues from the prompt and the first token, the prompt's full blocks imported
    handed, _ = run(LLMEngine(cfg), prompt + first, SamplingParams(max_tokens=3000), kv_payloads=payloads)
    assert first + handed.token_ids == whole and handed.num_cached_tokens > 0
    # a request moved mid-answer is recomputed from its prompt and what it streamed: it ends where it would
    moved, _ = run(LLMEngine(cfg), prompt + whole[:len(whole) // 2], SamplingParams(max_tokens=3000))
    assert whole[:len(whole) // 2] + moved.token_ids == whole


def test_moving_kv_costs_the_modelled_bytes_over_the_modelled_network(cfg):
    engine = LLMEngine(cfg)
    cost = engine.runner.modelled.cost
    assert engine.runner.modelled.transfer_seconds(1000) == pytest.approx(1000 * cost.kv_bytes_per_token
                                                                 / cost.network_bytes_per_s / cfg.emulation_speedup)


def test_a_cpp_hop_costs_what_the_simulator_charges_a_stage_boundary(cfg):
    """The hidden states of a 2,048-token chunk, sent over an emulated instance's modelled network
    (transfer/modelled.py, set from its runner as Worker.modelled does), take what the simulator charges."""
    import torch

    from mooncake.conductor.cpp import CppSettings
    from mooncake.hidden_payload import encode_hidden
    from mooncake.registry import load_backend
    from mooncake.transfer.modelled import ModelledNetwork

    engine = LLMEngine(cfg)
    cost = engine.runner.modelled.cost
    sim = CppSettings(2, 0, 2048, cost.activation_bytes_per_token)  # as mooncake/sim/disaggregated.py makes it
    assert engine.runner.modelled.activation_seconds(2048) == pytest.approx(2048 * engine.runner.modelled.activation_seconds(1))
    network = ModelledNetwork(load_backend("transports", "inproc")(), 0.0, 1, engine.runner.modelled.activation_seconds(1))
    hop_s = network.modelled_s([encode_hidden(torch.zeros(2048, 4))])
    assert hop_s > 0
    assert hop_s == pytest.approx(sim.hop_s(2048, cost.network_bytes_per_s) / cfg.emulation_speedup)


def test_back_to_back_steps_keep_the_emulated_devices_clock_when_the_host_hands_back_late(cfg):
    """Each step of a busy engine loop starts at the previous one's modelled end, however late the event
    loop took the previous one back, so the box's lateness does not add up over a queue of steps."""
    import asyncio
    import time

    from mooncake.instance.engine_loop import EngineLoop

    engine = LLMEngine(dataclasses.replace(cfg, emulation_speedup=10))  # decode steps of ~2 ms
    steps = []  # (since, modelled_end, handed back at) per step
    real_step = engine.step

    def step(since=None):
        outputs = real_step(since)
        steps.append((since, engine.modelled_end, time.perf_counter()))
        return outputs

    engine.step = step

    async def on_outputs(outputs):
        time.sleep(0.004)  # the loop is busy with something else when the next step ends

    async def on_failed(request_ids, error, is_invalid=False):
        raise AssertionError(error)

    async def main():
        loop = EngineLoop(engine, on_outputs, on_failed)
        loop.start()
        try:
            await loop.call(engine.add_request, list(range(5, 60)), SamplingParams(max_tokens=20, ignore_eos=True))
            while engine.has_unfinished():
                await asyncio.sleep(0.01)
        finally:
            await loop.stop()

    asyncio.run(main())
    assert len(steps) >= 20
    assert all(s[2] >= s[1] for s in steps)  # the sleep never ends a step early
    back_to_back = [(prev, cur) for prev, cur in zip(steps, steps[1:]) if cur[0] is not None and cur[0] > prev[0]]
    assert len(back_to_back) >= 15
    for prev, cur in back_to_back:
        assert cur[0] == prev[1]  # not the later time at which the loop took the previous step back


def test_a_stages_chunks_keep_the_emulated_devices_clock_when_the_host_hands_back_late(cfg):
    """A CPP stage's chunk that was ready when the last one ended starts at that one's modelled end: the
    host's lateness between chunks (here 15 ms each) shortens the next chunk instead of adding up. Without
    `since`, a chunk starts when it is called."""
    import time

    from mooncake.engine.stage import PipelineStage

    engine = LLMEngine(dataclasses.replace(cfg, emulation_speedup=0.1))  # ~67 ms per 64-token chunk
    stage = PipelineStage(engine, range(0, engine.runner.kv_spec.num_layers))
    stage.begin("r1", list(range(3, 259)))
    stage.begin("r2", list(range(3, 259)))
    for rid, back_to_back in (("r1", True), ("r2", False)):
        since, chunks = None, []
        for i in range(4):
            called = time.perf_counter()
            stage.run(rid, 64, None, since)
            end = stage.modelled_end(rid)
            modelled = engine.runner.modelled
            chunks.append((since or called, end, modelled.cost.step_s([(64 * (i + 1), 64 * i)]) / modelled.speedup))
            time.sleep(0.015)  # the host hands the chunk back late
            since = end if back_to_back else None
        for start, end, modelled in chunks:
            assert end == pytest.approx(start + modelled, abs=0.002)
        gaps = [later[0] - earlier[1] for earlier, later in zip(chunks, chunks[1:])]
        assert all(gap == 0 for gap in gaps) if back_to_back else all(gap >= 0.015 for gap in gaps)


def test_prompt_logprobs_at_each_position_are_what_that_prefix_alone_would_sample_from(cfg):
    """Rows inside a prefill chunk (prompt logprobs) read the context up to their own position."""
    engine = LLMEngine(cfg)
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 300, 150)]  # two of 64 and one of 22
    asked = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    out, _ = run(engine, prompt, asked)
    assert len(out.prompt_logprobs) == len(prompt) - 1 and out.token_ids == run(engine, prompt)[0].token_ids[:2]
    for end in (1, 40, 64, 65, 100, 149):  # prefix prompt[:end]: its row predicts prompt[end]
        alone, _ = run(engine, prompt[:end], SamplingParams(max_tokens=1, logprobs=3))
        assert out.prompt_logprobs[end - 1].top == alone.logprobs[0].top

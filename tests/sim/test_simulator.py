"""The simulator: deterministic, driven by the conductor's own policy classes, and on the real trace
showing the orderings the paper reports."""

from pathlib import Path

import pytest

from mooncake.conductor.admission import PredictiveRejection
from mooncake.conductor.decide import Decider
from mooncake.conductor.policies import KVCacheCentricPolicy
from mooncake.config import load_config
from mooncake.errors import ConfigError
from mooncake.cost import CostModel
from mooncake.sim.disaggregated import DisaggregatedCluster
from mooncake.sim.run import simulate

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
needs_trace = pytest.mark.skipif(not TRACE.exists(), reason="shared trace not beside the checkout")


def small_trace(tmp_path, n=300):
    """Conversations that share a system prompt and grow turn by turn, two requests a second."""
    lines = []
    for i in range(n):
        conv, turn = i % 20, i // 20
        hashes = [0] + [1000 * conv + k for k in range(1, 3 + 2 * turn)]
        lines.append(f'{{"timestamp": {i * 500}, "input_length": {len(hashes) * 512 - 100}, '
                     f'"output_length": {50 + (i * 37) % 300}, "hash_ids": {hashes}}}')
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def config(path="configs/sim/mooncake-8p8d.toml", **overrides):
    return load_config(ROOT / path, overrides)


def test_same_input_same_result(tmp_path):
    trace = small_trace(tmp_path)
    first = simulate(trace, config(**{"conductor.placement": "random"}))
    again = simulate(trace, config(**{"conductor.placement": "random"}))
    first.pop("wall_s"), again.pop("wall_s")
    assert first == again


def test_simulator_decides_through_the_conductors_decision_core():
    cfg = config(**{"conductor.admission": "predictive"})
    cluster = DisaggregatedCluster(cfg.sim, cfg.conductor, CostModel())
    assert type(cluster.decider) is Decider
    assert type(cluster.decider.policy) is KVCacheCentricPolicy
    assert type(cluster.decider.admission) is PredictiveRejection
    assert cluster.decider.policy.index is cluster.index  # the index the simulated pool keeps up to date


def test_every_request_is_accounted_for_and_tokens_are_in_order(tmp_path):
    trace = small_trace(tmp_path)
    cfg = config()
    cluster = DisaggregatedCluster(cfg.sim, cfg.conductor, CostModel())
    from mooncake.sim.trace import load_trace
    requests = load_trace(trace)
    records = cluster.run(requests)
    assert len(records) == len(requests)
    for record, request in zip(sorted(records, key=lambda r: r.request_id), requests):
        assert record.rejected_at is None and len(record.token_times) == request.output_length
        assert record.token_times == sorted(record.token_times) and record.ttft_s > 0
    assert sum(r.cached_tokens for r in records) > 0  # conversations reuse their earlier turns


@pytest.mark.slow  # the whole trace, simulated several times
@needs_trace
def test_global_cache_aware_beats_local_beats_load_balancing_beats_random():
    ttft = {p: simulate(TRACE, config(**{"conductor.placement": p}))["ttft_s"]["mean"]
            for p in ("kvcache-centric", "local-cache-aware", "least-loaded", "random")}
    assert ttft["kvcache-centric"] < ttft["local-cache-aware"] < ttft["least-loaded"] < ttft["random"]


@pytest.mark.slow  # the whole trace, simulated several times
@needs_trace
def test_mooncake_serves_more_within_slo_than_vllm_and_most_at_the_strictest_tbt():
    ours = simulate(TRACE, config())["effective_capacity"]
    vllm = simulate(TRACE, config("configs/sim/vllm-16.toml"))["effective_capacity"]
    gains = [ours[t] / vllm[t] - 1 for t in ("100ms", "200ms", "300ms")]
    assert all(g > 0 for g in gains)
    assert gains[0] > gains[1] > gains[2]  # the gain shrinks as the TBT threshold loosens



def test_plots_and_load_samples(tmp_path):
    pytest.importorskip("matplotlib")
    from mooncake.sim.plots import capacity_curve, write_plots
    result = simulate(small_trace(tmp_path), config())
    assert result["load_over_time"] and all(len(s) == 3 for s in result["load_over_time"])
    curve = capacity_curve(result)
    assert all(a <= b for a, b in zip(curve, curve[1:]))  # looser threshold, never fewer requests
    paths = write_plots({"a": result, "b": result}, tmp_path / "plots")
    assert {p.name for p in paths} == {"ttft_cdf.png", "tbt_cdf.png", "capacity_vs_threshold.png",
                                       "load_over_time.png"}
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_sweep_runs_every_speed_and_split(tmp_path):
    from mooncake.sim.run import sweep
    rows = sweep(small_trace(tmp_path), config(), speeds=[1.0, 4.0], pd_ratios=[(2, 2), (3, 1)])
    assert [(r["speed"], r["prefill"], r["decode"]) for r in rows] == [(1.0, 2, 2), (1.0, 3, 1), (4.0, 2, 2),
                                                                       (4.0, 3, 1)]
    by = {(r["speed"], r["prefill"]): r for r in rows}
    assert by[(4.0, 2)]["mean_ttft_s"] >= by[(1.0, 2)]["mean_ttft_s"]  # more load, no faster first tokens


def test_decode_nodes_dram_joins_the_pool(tmp_path):
    """Tiny per-node pools: with decode DRAM pooled the cluster holds twice the blocks, hits more, and
    decode nodes show up as holders prefill instances may fetch from."""
    from mooncake.sim.trace import load_trace
    requests = load_trace(small_trace(tmp_path))
    hit = {}
    for pooled in (False, True):
        cfg = config(**{"sim.pool_decode_dram": pooled, "sim.dram_blocks_per_node": 4})
        cluster = DisaggregatedCluster(cfg.sim, cfg.conductor, CostModel())
        records = cluster.run(requests)
        hit[pooled] = sum(r.cached_tokens for r in records)
        for decode_id, decode in cluster.decodes.items():
            if pooled:
                assert decode.pool.blocks and all(decode_id in cluster.index.holders(b) for b in decode.pool.blocks)
            else:
                assert decode.pool is None
    assert hit[True] > hit[False]


def test_decode_cost_keys_reach_the_cost_model(tmp_path):
    trace = small_trace(tmp_path)
    fast = simulate(trace, config(**{"sim.decode_overhead_s": 0.0}))["tbt_s"]["mean"]
    slow = simulate(trace, config(**{"sim.decode_overhead_s": 0.05}))["tbt_s"]["mean"]
    assert slow > fast + 0.04  # every step pays the overhead
    with pytest.raises(ConfigError, match="sim.decode_efficiency"):
        config(**{"sim.decode_efficiency": 1.5})


def test_vllm_chunked_prefill_bounds_the_stall_a_prefill_puts_on_decode(tmp_path):
    """Without chunking a whole prompt runs in one step and every decode waits for it; with a 512-token
    budget a step carries at most that much prefill, so the worst token gap is far shorter."""
    trace = small_trace(tmp_path)
    worst = {}
    for chunked in (True, False):
        result = simulate(trace, config("configs/sim/vllm-16.toml", **{"sim.chunked_prefill": chunked,
                                                                        "sim.num_instances": 2}))
        worst[chunked] = max(result["per_request"]["tbt_s"])
    cost = CostModel()
    assert worst[True] < cost.prefill_s(16_000 + 512, 16_000) + 0.1  # one chunk at the longest context, + decode
    assert worst[False] > 2 * worst[True]


@pytest.mark.slow  # the whole trace, simulated several times
@needs_trace
def test_rejection_study_rejecting_at_arrival_wastes_less_than_the_baseline():
    """configs/sim/rejection-8p8d-2x.toml: 8P+8D around 2x speed, decode the bottleneck. The baseline
    wastes prefill on requests decode then refuses; rejecting at arrival, on current decode load (early)
    or on the load predicted for when the request gets to decode (predictive), rejects fewer over the
    sweep. NOTE: which of early and predictive rejects fewest is not stable in this simulator (paper:
    4183 / 3771 / 3589 at 2x): at 1.8x the baseline rejects fewest, at 2.2x early; at 2.0x predictive beat
    early by 1.7% until the estimators' refit (equal to the seed within 1e-12) broke ties another way."""
    total = {a: sum(sum(simulate(TRACE, config("configs/sim/rejection-8p8d-2x.toml", **{
        "conductor.admission": a, "sim.speed": speed}))["rejected"].values()) for speed in (1.8, 2.0, 2.2))
        for a in ("ttft-only", "early", "predictive")}
    assert total["ttft-only"] > max(total["early"], total["predictive"])


def long_prompts(tmp_path, count=1, tokens=131072):
    """`count` cold prompts of `tokens` tokens arriving together, nothing shared."""
    blocks = tokens // 512
    lines = [f'{{"timestamp": 0, "input_length": {tokens}, "output_length": 4, '
             f'"hash_ids": {list(range(i * blocks, (i + 1) * blocks))}}}' for i in range(count)]
    path = tmp_path / "long.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_cpp_groups_run_a_long_prompt_as_a_pipeline(tmp_path):
    """Four prefill nodes as one CPP group of 4 prefill a 128k-token prompt close to 4x faster than one node
    (the cost model's pipeline); a second prompt follows the first through the stages, ending one stage's
    share later, not a whole pipeline later; every request is served, its tokens in order."""
    ttft = {}
    for x in (1, 2, 4):
        cfg = config(**{"sim.num_prefill": 4, "sim.num_decode": 1, "conductor.cpp_stages": x})
        result = simulate(long_prompts(tmp_path), cfg)
        ttft[x] = result["ttft_s"]["mean"]
    whole = CostModel().prefill_s(131072)
    assert ttft[1] == pytest.approx(whole, rel=0.01)
    assert whole / 2 < ttft[2] < whole / 1.8 and whole / 4 < ttft[4] < whole / 3.5
    cfg = config(**{"sim.num_prefill": 4, "sim.num_decode": 1, "conductor.cpp_stages": 4})
    cluster = DisaggregatedCluster(cfg.sim, cfg.conductor, CostModel())
    from mooncake.sim.trace import load_trace
    first, second = sorted(cluster.run(load_trace(long_prompts(tmp_path, count=2))), key=lambda r: r.ttft_s)
    assert second.ttft_s - first.ttft_s == pytest.approx(whole / 4, rel=0.02)
    assert all(len(r.token_times) == 4 and r.token_times == sorted(r.token_times) for r in (first, second))


def test_cpp_groups_need_whole_groups_of_prefill_nodes():
    cfg = config(**{"sim.num_prefill": 6, "conductor.cpp_stages": 4})
    with pytest.raises(ConfigError, match=r"sim.num_prefill = 6 .*conductor.cpp_stages = 4"):
        DisaggregatedCluster(cfg.sim, cfg.conductor, CostModel())
    with pytest.raises(ConfigError, match="conductor.cpp_stages"):
        config(**{"conductor.cpp_stages": 0})


def test_under_a_cap_each_request_writes_the_emulated_models_answer_and_the_conductor_learns_it(tmp_path):
    """sim.max_tokens: requests ask a cap and write what the emulated model answers their prompt with (as a
    live replay gets it); the simulated conductor is told neither, and learns lengths from answers that end."""
    from mooncake.answer_lengths import AnswerLengths, answer_token_ids
    from mooncake.models.catalog import CATALOG
    from mooncake.sim.trace import load_trace, trace_prompt, with_emulated_answers
    import tomllib

    requests = load_trace(small_trace(tmp_path, n=120))
    answered = with_emulated_answers(requests, 400)
    answers = AnswerLengths(tomllib.loads(CATALOG["emulated-llama3-70b"].spec_path.read_text())["answers"]["quantiles"])
    for request, got in zip(requests, answered):
        prompt = trace_prompt(request.hash_ids, 512, request.input_length)
        assert len(prompt) == request.input_length
        assert got.output_length == min(400, answers.of_prompt(prompt, answer_token_ids()))
    assert len({r.output_length for r in answered}) > 20 and max(r.output_length for r in answered) == 400
    cfg = config(**{"sim.max_tokens": 400})
    cluster = DisaggregatedCluster(cfg.sim, cfg.conductor, CostModel())
    records = cluster.run(answered)
    assert sorted(len(r.token_times) for r in records) == sorted(r.output_length for r in answered)
    learned = cluster.est.output_length
    assert learned.num_samples == len(answered)
    mean = sum(r.output_length for r in answered) / len(answered)
    assert learned.expected(400) == pytest.approx(mean, abs=1)


def test_estimators_that_start_twice_off_converge_from_what_they_observe(tmp_path):
    cfg = config(**{"conductor.estimator_prior_scale": 2.0})
    cluster = DisaggregatedCluster(cfg.sim, cfg.conductor, CostModel())
    assert cluster.est.prefill_time.predict(8000) == pytest.approx(2 * CostModel().prefill_s(8000))
    from mooncake.sim.trace import load_trace
    records = sorted(cluster.run(load_trace(small_trace(tmp_path))), key=lambda r: r.arrival_s)
    ratios = [r.predicted_ttft_s / r.ttft_s for r in records]
    assert ratios[0] == pytest.approx(2.0, rel=0.05)  # an idle cluster: the prediction is the prior's
    assert all(0.9 < x < 1.1 for x in ratios[-100:])  # refitted from the prefills it saw
    assert cluster.est.prefill_time.predict(8000) == pytest.approx(CostModel().prefill_s(8000), rel=0.05)

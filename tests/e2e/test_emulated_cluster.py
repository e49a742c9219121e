"""The emulated LLaMA3-70B served by a whole cluster (every role its own process): the stream through the
API, across the prefill-to-decode hand-off, is the one the emulated engine gives alone (log-probabilities
included), and a prefix is reused."""

import pytest

from mooncake.config import EngineConfig
from mooncake.engine import LLMEngine, SamplingParams
from tests.e2e.conftest import make_cluster, metrics, post, wait_for

SPEEDUP = 200.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with make_cluster(tmp_path_factory, "tcp", **{"engine.model": "emulated-llama3-70b", "api.model_name": "emu",
                                                  "engine.emulation_speedup": SPEEDUP}) as c:
        yield c


def test_the_emulated_model_streams_across_the_hand_off_as_it_does_alone(cluster):
    prompt = [5 + (i * 7) % 250 for i in range(300)]  # token ids: what a trace replay sends
    status, reply = post(cluster.url + "/v1/completions", {"model": "emu", "prompt": prompt, "max_tokens": 20,
                                                           "temperature": 0, "ignore_eos": True,
                                                           "return_token_ids": True, "logprobs": 1})
    assert status == 200, reply
    choice = reply["choices"][0]
    cfg = cluster.config.engine
    alone = LLMEngine(EngineConfig(model=cfg.model, block_size=cfg.block_size, prefill_chunk=cfg.prefill_chunk,
                                   num_kv_blocks=64, emulation_speedup=SPEEDUP))
    (expected,) = alone.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))
    assert choice["token_ids"] == expected.token_ids and len(choice["logprobs"]["token_logprobs"]) == 20

    before = metrics(cluster.url)
    status, again = post(cluster.url + "/v1/completions", {"model": "emu", "prompt": prompt + [9] * 40,
                                                           "max_tokens": 4, "temperature": 0})
    assert status == 200 and again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 288
    assert metrics(cluster.url)["mooncake_prompt_tokens_total"] > before["mooncake_prompt_tokens_total"]


def test_emulated_instances_seed_the_conductors_estimators_with_their_cost_model(cluster):
    log = (cluster.workdir / "conductor.log").read_text()
    assert "seeds the PrefillTimeModel" in log and "seeds the DecodeStepModel" in log
    assert "mooncake_ttft_prediction_ratio_count" in "".join(metrics(cluster.url))


def test_the_conductor_exports_how_far_emulated_steps_fall_behind_the_model(cluster):
    """Each step an emulated instance runs reaches the conductor as measured over modelled time; a step
    never beats the model (the runner waits out the modelled time), so every ratio is at least 1."""
    status, _ = post(cluster.url + "/v1/completions", {"model": "emu", "prompt": [11] * 100, "max_tokens": 8})
    assert status == 200
    count = {role: f'mooncake_emulated_step_ratio_count{{role="{role}"}}' for role in ("prefill", "decode")}
    wait_for(lambda: all(metrics(cluster.url).get(series, 0) > 0 for series in count.values()), 10,
             "step ratios from both roles' heartbeats")
    seen = metrics(cluster.url)
    for role, series in count.items():
        assert seen[f'mooncake_emulated_step_ratio_sum{{role="{role}"}}'] >= seen[series]
        assert seen[f'mooncake_emulated_step_ratio_bucket{{le="1.0",role="{role}"}}'] == 0


def test_the_colocated_baseline_serves_the_same_stream_from_one_instance(tmp_path_factory):
    settings = {"engine.model": "emulated-llama3-70b", "api.model_name": "emu", "conductor.mode": "colocated",
                "engine.emulation_speedup": SPEEDUP}
    prompt = [5 + (i * 11) % 250 for i in range(200)]
    body = {"model": "emu", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    with make_cluster(tmp_path_factory, "tcp", num_prefill=0, num_decode=2, **settings) as colocated:
        status, reply = post(colocated.url + "/v1/completions", body)
        assert status == 200, reply
        status, again = post(colocated.url + "/v1/completions", {**body, "prompt": prompt + [7] * 20})
        assert status == 200 and again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # no pool
        served = metrics(colocated.url)
    cfg = colocated.config.engine
    alone = LLMEngine(EngineConfig(model=cfg.model, block_size=cfg.block_size, prefill_chunk=cfg.prefill_chunk,
                                   num_kv_blocks=64, emulation_speedup=SPEEDUP))
    (expected,) = alone.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))
    assert reply["choices"][0]["token_ids"] == expected.token_ids
    assert not any(k.startswith("mooncake_prefill_computed_tokens_total") for k in served)  # no prefill role

"""bench_goodput.py --real's parts that need no live cluster: scripts/profile_engine.py's fit recovers a cost
model from the times it would produce, the simulator runs on a fitted [cost] table (sim.cost_file) and says
which key is wrong, and the trace slice is scaled to the model's context with its prefixes kept shared."""

import dataclasses
import json

import pytest

from mooncake.config import load_config
from mooncake.cost import CostModel
from mooncake.errors import ConfigError, ModelError
from mooncake.sim.run import sim_cost, simulate_requests
from mooncake.sim.trace import TraceRequest
from scripts.goodput_real import BLOCK, scaled
from scripts.profile_engine import fit, recorded, shape_of

SMOLLM2 = {"hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536, "num_attention_heads": 9,
           "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}


def test_the_fit_recovers_the_cost_model_that_made_the_times():
    truth = CostModel(**shape_of(SMOLLM2), a=6.0, gpu_flops=40e9, mfu=1.0, hbm_bytes_per_s=12e9,
                      decode_efficiency=1.0, decode_overhead_s=0.004)
    prefill = [(n, truth.prefill_s(n)) for n in (128, 512, 1024, 2048, 4096)]
    decode = [(b, c, truth.step_s([], b, b * c)) for b in (1, 4, 16) for c in (256, 2048)]
    mixed = [(b, 256, 512, truth.step_s([(512, 0)], b, b * 256)) for b in (1, 4, 16)]
    table, rows, errors = fit(SMOLLM2, prefill, decode, mixed)
    assert table["step_model"] == "roofline" and errors["roofline"] < 0.03 < errors["additive"]
    assert table["gpu_flops"] == pytest.approx(40e9, rel=1e-6) and table["a"] == pytest.approx(6.0, rel=1e-6)
    assert table["hbm_bytes_per_s"] == pytest.approx(12e9, rel=0.05)
    assert table["decode_overhead_s"] == pytest.approx(0.004, rel=0.1)
    assert all(row["fitted_s"]["roofline"] / row["measured_s"] == pytest.approx(1.0, abs=0.03) for row in rows), rows
    assert shape_of(SMOLLM2)["weight_bytes"] == pytest.approx(4 * 134.5e6, rel=0.01)  # SmolLM2-135M in float32


def test_on_a_core_whose_steps_add_up_the_additive_fit_recovers_them_and_is_chosen():
    """A CPU core does not overlap a prefill chunk's compute with a decode batch's reads, and pays per row:
    times made by the additive model with a per-row cost are fitted back exactly, mixed steps included, and
    that model is chosen over the roofline (which would price a mixed step at the larger part alone)."""
    truth = CostModel(**shape_of(SMOLLM2), a=6.0, gpu_flops=40e9, mfu=1.0, hbm_bytes_per_s=12e9,
                      decode_efficiency=1.0, decode_overhead_s=0.004, decode_row_s=0.003, step_model="additive")
    prefill = [(n, truth.prefill_s(n)) for n in (128, 512, 1024, 2048, 4096)]
    decode = [(b, c, truth.step_s([], b, b * c)) for b in (1, 4, 16) for c in (256, 1024, 2048)]
    mixed = [(b, 256, 512, truth.step_s([(512, 0)], b, b * 256)) for b in (1, 4, 16)]
    table, rows, errors = fit(SMOLLM2, prefill, decode, mixed)
    assert table["step_model"] == "additive" and errors["additive"] < 1e-6 < errors["roofline"]
    assert table["decode_row_s"] == pytest.approx(0.003, rel=1e-6)
    assert table["hbm_bytes_per_s"] == pytest.approx(12e9, rel=1e-6)
    assert table["decode_overhead_s"] == pytest.approx(0.004, rel=1e-6)
    fitted = CostModel(**{k: v for k, v in table.items() if k != "other_fits"})
    assert fitted.decode_coefficients() == pytest.approx(truth.decode_coefficients(), rel=1e-6)
    assert table["other_fits"]["roofline"]["step_model"] == "roofline"
    assert fit(SMOLLM2, prefill, decode, mixed, "roofline")[0]["step_model"] == "roofline"  # as asked


def test_a_profiles_points_are_fitted_again_from_its_json(tmp_path):
    """--refit: the points a profile wrote give the table its measurement gave."""
    truth = CostModel(**shape_of(SMOLLM2), a=6.0, gpu_flops=40e9, mfu=1.0, hbm_bytes_per_s=12e9,
                      decode_efficiency=1.0, decode_overhead_s=0.004, decode_row_s=0.003, step_model="additive")
    measured = {"config": SMOLLM2, "prefill": [(n, truth.prefill_s(n)) for n in (128, 1024, 4096)],
                "decode": [(b, c, truth.step_s([], b, b * c) * (1.1 if b == 4 else 1.0)) for b in (1, 4, 16)
                           for c in (256, 2048)],
                "mixed": [(4, 256, 512, truth.step_s([(512, 0)], 4, 1024))]}
    table, rows, errors = fit(measured["config"], measured["prefill"], measured["decode"], measured["mixed"])
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"model": "smollm2-135m-instruct", "config": SMOLLM2, "points": rows}))
    again = recorded(path, "unused")
    assert again == {k: [tuple(p) for p in v] if k != "config" else v for k, v in measured.items()}
    assert fit(again["config"], again["prefill"], again["decode"], again["mixed"]) == (table, rows, errors)


def test_the_simulator_charges_a_fitted_cost_table_and_names_what_is_wrong_in_it(tmp_path):
    requests = [TraceRequest(i * 60_000, 1024, 16, tuple(range(i * 16, i * 16 + 16))) for i in range(4)]

    def ttft(flops: float) -> float:
        path = tmp_path / f"cost-{flops:g}.toml"
        path.write_text(f"[cost]\nlayers = 30\nd_model = 576\nb = 21.3\ngpus_per_node = 1\ngpu_flops = {flops}\n"
                        "mfu = 1.0\nkv_bytes_per_token = 46080\nweight_bytes = 5.4e8\n")
        config = load_config(None, {"sim.cost_file": str(path), "sim.num_prefill": 1, "sim.num_decode": 1,
                                    "sim.block_tokens": BLOCK})
        return simulate_requests(requests, config)["ttft_s"]["mean"]

    assert ttft(20e9) > 1.8 * ttft(40e9)  # nothing queues here: half the FLOP/s, about twice the TTFT
    with pytest.raises(ConfigError, match="sim.cost_file"):
        sim_cost(load_config(None, {"sim.cost_file": str(tmp_path / "missing.toml")}).sim)
    (tmp_path / "bad.toml").write_text("[cost]\ngpu_flop = 1e9\n")
    with pytest.raises(ModelError, match="gpu_flop"):
        sim_cost(load_config(None, {"sim.cost_file": str(tmp_path / "bad.toml")}).sim)


def test_the_real_replay_scales_each_prompt_into_the_context_and_keeps_its_prefix_blocks():
    trace = [TraceRequest(0, 512 * 10 - 100, 50, tuple(range(10))),
             TraceRequest(5, 512 * 200, 50, tuple(range(200)))]  # longer than the context when scaled
    short, long = scaled(trace, BLOCK / 512, 8192, 128)
    assert short.input_length == round((512 * 10 - 100) * BLOCK / 512) and short.hash_ids == tuple(range(10))
    assert long.input_length == 8192 - 128 and long.hash_ids == tuple(range(-(-long.input_length // BLOCK)))
    assert dataclasses.replace(short, input_length=0, hash_ids=()) == dataclasses.replace(
        trace[0], input_length=0, hash_ids=())  # times and output lengths untouched


def test_the_simulator_charges_steps_as_the_cost_file_says_unless_told_otherwise(tmp_path):
    path = tmp_path / "cost.toml"
    path.write_text("[cost]\nlayers = 30\nd_model = 576\ndecode_row_s = 0.002\nstep_model = 'additive'\n")
    assert sim_cost(load_config(None, {"sim.cost_file": str(path)}).sim).step_model == "additive"
    told = load_config(None, {"sim.cost_file": str(path), "sim.step_model": "roofline"}).sim
    assert sim_cost(told).step_model == "roofline" and sim_cost(told).decode_row_s == 0.002
    assert sim_cost(load_config(None, {}).sim).step_model == "roofline"  # the testbed's default
    with pytest.raises(ConfigError, match="sim.step_model"):
        load_config(None, {"sim.step_model": "sum"})

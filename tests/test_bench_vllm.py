"""scripts/bench_vllm.py's own arithmetic and parsing (the benchmark itself downloads vLLM: not in the tests):
ratios are ours over vLLM's with higher better whichever way a figure points, and a probe's figures are its
last JSON line whatever it logged before; a probe that fails says so with its output."""

import json

import pytest

from scripts.bench_vllm import best_of, ratios, run_probe

OURS = {"throughput_tok_s": 300.0, "prefill_2048_s": 2.0, "decode_b1_step_s": 0.03, "decode_b32_step_s": 0.2,
        "cpu_s_per_token": 0.004}
THEIRS = {"throughput_tok_s": 400.0, "prefill_2048_s": 3.0, "decode_b1_step_s": 0.02, "decode_b32_step_s": 0.16,
          "cpu_s_per_token": 0.003}


def test_ratios_are_ours_over_theirs_with_higher_better():
    got = ratios(OURS, THEIRS)
    assert got == pytest.approx({"throughput": 0.75, "prefill_2048": 1.5, "decode_b1": 2 / 3, "decode_b32": 0.8,
                                 "cpu_per_token": 0.75})


def test_a_probes_figures_are_its_last_json_line(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'INFO 12-07 loading weights {not json'\necho '{\"old\": 1}'\n"
                    f"echo '{json.dumps(OURS)}'\n")
    fake.chmod(0o755)
    assert run_probe(str(fake), "vllm", "/nowhere", 30) == OURS
    fake.write_text("#!/bin/sh\necho 'Traceback: no module named vllm' >&2\nexit 1\n")
    with pytest.raises(SystemExit, match="(?s)the vllm probe failed.*no module named vllm"):
        run_probe(str(fake), "vllm", "/nowhere", 30)


def test_the_best_of_rounds_takes_each_figures_best_and_keeps_the_rest():
    slow = {**OURS, "throughput_tok_s": 250.0, "decode_b1_step_s": 0.025, "greedy": [[1, 2]]}
    fast = {**OURS, "prefill_2048_s": 2.5, "greedy": [[3]]}
    best = best_of([slow, fast])
    assert best["throughput_tok_s"] == 300.0  # the higher rate
    assert best["decode_b1_step_s"] == 0.025 and best["prefill_2048_s"] == 2.0  # the lower times
    assert best["greedy"] == [[1, 2]]  # not a figure: the first round's
    assert best_of([fast]) == fast

"""scripts/bench_streaming.py on the tiny model and the emulated one: every mode is measured
through the API in rounds, and the JSON carries the keys the issue names, each mode's per-round ratios to
compute alone and an interval around their median."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # make test skips it; make test-all and .ci/run run it


def test_a_short_streaming_run_measures_every_mode(tmp_path, tiny_dir):
    out = tmp_path / "streaming.json"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    run = subprocess.run([sys.executable, "scripts/bench_streaming.py", "--models", "tiny-llama,emulated-llama3-70b",
                          "--prompt-tokens", "256", "--chunk", "64", "--repeats", "2", "--json", str(out)],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "TMPDIR": str(scratch)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert not list(scratch.glob("bench-streaming-*"))  # the clusters' logs went with a run that passed
    result = json.loads(out.read_text())
    for model in ("tiny-llama", "emulated-llama3-70b"):
        ttft = result["models"][model]["ttft_s"]
        assert all(ttft[m] > 0 for m in ("layerwise", "chunkwise", "at_end", "compute_only")), (model, ttft)
        r = result["models"][model]
        assert r["over_compute_only"]["compute_only"] == 1.0
        for mode in ttft:  # every mode once per round, its ratio to that round's compute_only
            assert len(r["samples_s"][mode]) == len(r["ratio_samples"][mode]) == 2, (model, mode, r)
            low, high = r["over_compute_only_90ci"][mode]
            assert min(r["ratio_samples"][mode]) <= low <= r["over_compute_only"][mode] <= high \
                <= max(r["ratio_samples"][mode]), (model, mode, r)
    assert result["ttft_s"] == result["models"]["tiny-llama"]["ttft_s"]
    assert result["over_compute_only"] == result["models"]["tiny-llama"]["over_compute_only"]

"""scripts/bench_cpp.py, small: both sources measure every group size, and the JSON has the issue's shape."""

import json
import subprocess
import sys


def test_a_short_cpp_run_measures_both_sources(tmp_path):
    out = tmp_path / "cpp.json"
    run = subprocess.run([sys.executable, "scripts/bench_cpp.py", "--tokens", "8192", "--stages", "1,2",
                          "--speedup", "20", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    for source in ("sim", "emulated"):
        assert set(result[source]["8192"]) == {"1", "2"} and all(v > 0 for v in result[source]["8192"].values())
        assert result["speedup"][source]["8192"]["1"] == 1.0
    assert result["speedup"]["sim"]["8192"]["2"] > 1.3  # simulated time: two stages share the chunks
    assert "8192" in run.stdout and "instances" in run.stdout

"""scripts/bench_decode_stall.py on the tiny model: every phase measures the running streams, and every
request that joins with its KV (on the KV thread, inline, or already local) is admitted and finishes."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # make test skips it; make test-all and .ci/run run it


def test_a_short_stall_run_admits_every_joiner_and_measures_every_phase(tmp_path, tiny_dir):
    out = tmp_path / "stall.json"
    run = subprocess.run([sys.executable, "scripts/bench_decode_stall.py", "--model", str(tiny_dir),
                          "--dtype", "float32", "--streams", "2", "--stream-blocks", "1", "--prompt-blocks", "2",
                          "--join-every", "0.2",
                          "--phase-s", "0.6", "--rounds", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["joiners"] >= 3 * 3 and result["joiners_finished"] == result["joiners"]
    for phase in ("no_arrivals", "local_hit", "kv_thread", "inline"):
        assert result["gaps"][phase] > 0 and result["tbt_p99_s"][phase] > 0, phase
    assert result["ratio_p99"]["no_arrivals"] == 1.0 and result["ratio_p99_to_local_hit"]["local_hit"] == 1.0

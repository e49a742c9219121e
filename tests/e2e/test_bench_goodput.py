"""scripts/bench_goodput.py on a handful of requests: it replays them through live Mooncake and live
colocated clusters of the emulated model and through the simulator, every request gets an answer as long
as the simulator computes (nobody told the cluster: the requests ask a cap), and it bisects capacity."""

import json
import subprocess
import sys

import pytest

from mooncake.sim.trace import TraceRequest
from scripts.bench_goodput import BURST_GAP_S, send_offsets_s

pytestmark = pytest.mark.slow  # make test skips it; make test-all and .ci/run run it


def test_a_small_goodput_replay_serves_every_request_live_and_simulated(tmp_path):
    out = tmp_path / "goodput.json"
    run = subprocess.run([sys.executable, "scripts/bench_goodput.py", "--requests", "8", "--prefill", "1",
                          "--decode", "1", "--speedup", "20", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    for where in ("live", "sim"):
        for mode in ("mooncake", "colocated"):
            figures = result[where][mode]["1"]
            assert figures["requests"] == 8 and figures["failed"] == 0, (where, mode, figures)
            assert set(figures["goodput"]) == {"0.1", "0.2", "0.3"} and figures["ttft_mean_s"] > 0
    assert result["live"]["mooncake"]["1"]["prediction_ratio"]["count"] >= 1
    for mode in ("mooncake", "colocated"):  # every answer ended with EOS where the simulator says it does
        assert result["live"][mode]["1"]["answers_as_simulated"] == 1.0, mode
    assert result["args"]["oracle"] == "False" and result["args"]["max_tokens"] == "2000"
    prediction = result["live"]["mooncake"]["1"]["prediction"]
    assert prediction["count"] >= 1 and 0 <= prediction["share_0.85_1.15"] <= 1
    assert sum(w["ttft"]["count"] for w in result["live"]["mooncake"]["1"]["prediction_over_time"]) \
        == result["live"]["mooncake"]["1"]["prediction_ratio"]["count"]
    for mode in ("mooncake", "colocated"):
        found = result["capacity"]["sim"][mode]
        assert set(found) == {"0.1", "0.2", "0.3"} and all(c["rate"] >= 0 for c in found.values())
    for mode in ("mooncake", "colocated"):  # the conductor's clock starts later and stops sooner than the client's
        live = result["live"][mode]["1"]
        assert 0 < live["conductor_ttft_mean_s"] <= live["ttft_mean_s"], (mode, live["conductor_ttft_mean_s"])
    steps = result["live"]["mooncake"]["1"]["step_ratio"]
    assert steps["prefill"]["count"] >= 1 and steps["decode"]["count"] >= 1 and steps["decode"]["mean"] >= 1
    assert (tmp_path / "goodput-vs-rate.png").stat().st_size > 0 and (tmp_path / "ttft-cdf.png").stat().st_size > 0


def test_requests_of_one_timestamp_leave_in_trace_order_a_gap_apart_and_others_at_their_time():
    trace = [TraceRequest(timestamp_ms=t, input_length=10, output_length=1, hash_ids=(i,))
             for i, t in enumerate((0, 0, 0, 3000, 3000, 6000))]
    offsets = send_offsets_s(trace, rate=2.0, speedup=1.0)
    assert offsets == [0.0, BURST_GAP_S, 2 * BURST_GAP_S, 1.5, 1.5 + BURST_GAP_S, 3.0]

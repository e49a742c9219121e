"""`mooncake simulate`: replay a trace through a simulated cluster and report (JSON, optional PNG CDFs)."""

import json
import sys
import time
from pathlib import Path

from mooncake.config import MooncakeConfig
from mooncake.sim.colocated import ColocatedCluster
from mooncake.sim.cost import CostModel
from mooncake.sim.disaggregated import DisaggregatedCluster
from mooncake.sim.metrics import report
from mooncake.sim.trace import load_trace


def simulate(trace_path: str | Path, config: MooncakeConfig, show_progress: bool = False) -> dict:
    trace = load_trace(trace_path)
    cost = CostModel(mfu=config.sim.mfu)
    if config.sim.mode == "mooncake":
        cluster = DisaggregatedCluster(config.sim, config.conductor, cost)
    else:
        cluster = ColocatedCluster(config.sim, cost)
    end_s = trace[-1].timestamp_ms / 1000 / config.sim.speed
    started = time.perf_counter()
    records = cluster.run(trace, _progress(end_s) if show_progress else None)
    result = report(records, prefill_gpu_s=cluster.prefill_gpu_s)
    result["config"] = {"sim": vars(config.sim), "conductor": vars(config.conductor)}
    result["wall_s"] = time.perf_counter() - started
    return result


def _progress(end_s: float):
    last = [0.0]

    def show(now: float) -> None:
        wall = time.perf_counter()
        if wall - last[0] >= 0.5:
            last[0] = wall
            done = min(1.0, now / end_s) if end_s else 1.0
            bar = "#" * int(done * 30)
            print(f"\r[{bar:<30}] {done:4.0%} simulated {now:,.0f} s", end="", file=sys.stderr, flush=True)
    return show


def write_report(result: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.json"
    path.write_text(json.dumps(result, indent=2))
    return path

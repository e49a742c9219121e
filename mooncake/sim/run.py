"""`mooncake simulate`: replay a trace through a simulated cluster and report (JSON, optional PNG CDFs)."""

import json
import sys
import time
import tomllib
from pathlib import Path

from mooncake.config import MooncakeConfig
from mooncake.sim.colocated import ColocatedCluster
from mooncake.cost import CostModel
from mooncake.errors import ConfigError
from mooncake.sim.disaggregated import DisaggregatedCluster
from mooncake.sim.config import SimConfig
from mooncake.sim.metrics import report
from mooncake.sim.trace import TraceRequest, load_trace, with_emulated_answers


def simulate(trace_path: str | Path, config: MooncakeConfig, show_progress: bool = False) -> dict:
    trace = load_trace(trace_path)
    if config.sim.max_tokens:  # under a cap, each request writes the emulated model's answer to its prompt
        trace = with_emulated_answers(trace, config.sim.max_tokens, config.sim.block_tokens)
    return simulate_requests(trace, config, show_progress)


def simulate_requests(trace: list[TraceRequest], config: MooncakeConfig, show_progress: bool = False) -> dict:
    """`simulate` of requests whose output lengths are what they will write (with_emulated_answers applied
    already when config.sim.max_tokens caps them)."""
    cost = sim_cost(config.sim)
    if config.sim.mode == "mooncake":
        cluster = DisaggregatedCluster(config.sim, config.conductor, cost)
    else:
        cluster = ColocatedCluster(config.sim, cost)
    end_s = trace[-1].timestamp_ms / 1000 / config.sim.speed
    started = time.perf_counter()
    records = cluster.run(trace, _progress(end_s) if show_progress else None)
    result = report(records, prefill_gpu_s=cluster.prefill_gpu_s)
    result["load_over_time"] = [[round(v, 4) for v in sample] for sample in cluster.load_samples]
    served = [r for r in records if r.rejected_at is None and r.token_times]
    result["per_request"] = {"ttft_s": [round(r.ttft_s, 4) for r in served],
                             "tbt_s": [round(r.tbt_s, 5) for r in served]}
    result["config"] = {"sim": vars(config.sim), "conductor": vars(config.conductor)}
    result["wall_s"] = time.perf_counter() - started
    return result


def sim_cost(sim: SimConfig) -> CostModel:
    """The simulated instances' cost model: LLaMA3-70B on 8 x A800 with the [sim] coefficients, or the [cost]
    table of `sim.cost_file`."""
    if not sim.cost_file:
        return CostModel(mfu=sim.mfu, decode_efficiency=sim.decode_efficiency, decode_overhead_s=sim.decode_overhead_s,
                         step_model=sim.step_model or "roofline")
    try:
        table = tomllib.loads(Path(sim.cost_file).read_text())["cost"]
    except (OSError, tomllib.TOMLDecodeError, KeyError) as exc:
        raise ConfigError(f"config key 'sim.cost_file': cannot read a [cost] table from {sim.cost_file}: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    return CostModel.from_dict({**table, "step_model": sim.step_model or table.get("step_model", "roofline")},
                               sim.cost_file)


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


def sweep(trace_path: str | Path, config: MooncakeConfig, speeds: list[float],
          pd_ratios: list[tuple[int, int]]) -> list[dict]:
    """One run per (speed, prefill:decode split); rows of the headline figures."""
    from dataclasses import replace
    rows = []
    for speed in speeds:
        for num_prefill, num_decode in pd_ratios or [(config.sim.num_prefill, config.sim.num_decode)]:
            sim = replace(config.sim, speed=speed, num_prefill=num_prefill, num_decode=num_decode)
            result = simulate(trace_path, replace(config, sim=sim))
            rows.append({"speed": speed, "prefill": num_prefill, "decode": num_decode,
                         "capacity": result["effective_capacity"], "mean_ttft_s": result["ttft_s"]["mean"],
                         "p90_tbt_s": result["tbt_s"]["p90"], "rejected": sum(result["rejected"].values()),
                         "wall_s": result["wall_s"]})
    return rows

#!/usr/bin/env python3
"""How large an emulated cluster this box can run at the trace's pace while keeping the emulated
hardware's timings (issue 14's scale question).

For each configuration (xPyD at a speedup), replays the trace's first N requests open-loop through the
live API of an emulated LLaMA3-70B Mooncake cluster (as scripts/bench_goodput.py does) and reads back,
from the conductor's mooncake_emulated_step_ratio histogram, each role's measured over modelled step time
(a step runs from the previous step's modelled end when they run back to back, so handling outputs
counts). A configuration keeps pace when both roles' mean ratio stays within 5% of the model. Also prints the conductor's CPU time per request and the
share of the box's CPUs every role used. The figures of a configuration that does not keep pace are the
box's, not the design's: compare goodput with the simulator only where it does.

    .venv/bin/python scripts/bench_scale.py                                  # 1P1D .. 8P8D at speedup 1
    .venv/bin/python scripts/bench_scale.py --configs 4x4@1 4x4@2 --requests 300

Writes JSON: configuration -> figures, and "largest_within_5pct"."""

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_goodput import live  # noqa: E402
from chaos import synthetic_trace  # noqa: E402
from mooncake.sim.trace import load_trace  # noqa: E402

PACE_TOLERANCE = 1.05  # measured over modelled step time, mean per role


def parse_config(text: str) -> tuple[int, int, float]:
    """'8x8@2' -> 8 prefill, 8 decode, speedup 2."""
    try:
        sizes, _, speedup = text.partition("@")
        prefill, decode = (int(n) for n in sizes.split("x"))
        return prefill, decode, float(speedup or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected PxD@SPEEDUP, e.g. 8x8@2") from None


def keeps_pace(result: dict) -> bool:
    steps = result["step_ratio"].values()
    return all(h["count"] and h["mean"] <= PACE_TOLERANCE for h in steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl")
    parser.add_argument("--requests", type=int, default=200, help="the trace's first N requests, per configuration")
    parser.add_argument("--configs", type=parse_config, nargs="+",
                        default=[parse_config(c) for c in ("1x1@1", "2x2@1", "4x4@1", "8x8@1")],
                        help="PxD@SPEEDUP, run in this order")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a request may take")
    parser.add_argument("--json", type=Path, default=Path("bench-results/scale.json"))
    args = parser.parse_args()
    if args.trace.exists():
        trace = load_trace(args.trace)[:args.requests]
    else:
        print(f"no trace at {args.trace}: replaying synthetic requests")
        trace = synthetic_trace(random.Random(0), args.requests)
    results = {}
    for prefill, decode, speedup in args.configs:
        run = argparse.Namespace(prefill=prefill, decode=decode, speedup=speedup, timeout=args.timeout)
        result = live("mooncake", trace, run, 1.0)
        result["keeps_pace"] = keeps_pace(result)
        results[f"{prefill}P{decode}D@{speedup:g}"] = result
    print(f"{len(trace)} requests at the trace's pace, emulated LLaMA3-70B; step ratio: measured/modelled")
    print(f"{'cluster':>12} {'prefill mean':>12} {'p90<=':>6} {'decode mean':>12} {'p90<=':>6} {'in 5%':>6} "
          f"{'cond ms/req':>11} {'box CPU':>8} {'good@0.1':>9} {'TTFT mean':>10} {'pace':>5}")
    for name, r in results.items():
        p, d = r["step_ratio"]["prefill"], r["step_ratio"]["decode"]
        print(f"{name:>12} {p['mean'] or 0:>12.3f} {p['p90_upper_bound'] or 0:>6g} {d['mean'] or 0:>12.3f} "
              f"{d['p90_upper_bound'] or 0:>6g} {d['within_5pct'] or 0:>6.0%} "
              f"{r['cpu_s']['conductor_ms_per_request']:>11.1f} {r['cpu_s']['box_share']:>8.0%} "
              f"{r['goodput']['0.1']:>9.3f} {r['ttft_mean_s']:>10.2f} {'yes' if r['keeps_pace'] else 'no':>5}")
    paced = [(p + d, s, name) for (p, d, s), name in zip(args.configs, results) if results[name]["keeps_pace"]]
    largest = max(paced)[2] if paced else None
    print(f"largest cluster within {PACE_TOLERANCE - 1:.0%} of the modelled step times: {largest or 'none'}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"configs": results, "largest_within_5pct": largest}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Goodput of the live system against the simulator, on the emulated LLaMA3-70B (DESIGN section 8).

Replays a slice of a Mooncake trace open-loop through the live OpenAI API (an async client sends each
request at its timestamp, divided by the rate factor and the emulation speedup): once against Mooncake
xPyD, once against the colocated baseline of x+y instances on the same emulated hardware; and runs the
simulator on the same slice and configuration. Times measured live are multiplied back by the speedup,
so every figure is in the emulated hardware's seconds. Goodput: the share (and rate) of requests with
TTFT <= 30 s and TBT <= 0.1 / 0.2 / 0.3 s (TBT as the paper: the mean of a request's slowest 10% of gaps).
Also: mean and p99 TTFT, rejections (429), failures, and the live conductor's predicted/measured TTFT.

    .venv/bin/python scripts/bench_goodput.py --quick              # 2P2D vs colocated 4, a small slice
    .venv/bin/python scripts/bench_goodput.py --requests 1000 --prefill 8 --decode 8 --rates 1 2

Writes JSON (keys live.mooncake, live.colocated, sim.mooncake, sim.colocated, each rate -> figures)."""

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from chaos import block_tokens, synthetic_trace  # noqa: E402
from mooncake.config import load_config  # noqa: E402
from mooncake.dev import DevCluster  # noqa: E402
from mooncake.sim.run import simulate  # noqa: E402
from mooncake.sim.trace import TraceRequest, load_trace  # noqa: E402

MODEL = "emulated-llama3-70b"
TTFT_SLO_S = 30.0
THRESHOLDS_S = (0.1, 0.2, 0.3)
TRACE_BLOCK = 512  # tokens per hash id in Mooncake traces


@dataclasses.dataclass
class Outcome:
    status: int = 0
    ttft_s: float | None = None  # emulated seconds
    gaps_s: list = dataclasses.field(default_factory=list)

    @property
    def tbt_s(self) -> float:
        slowest = sorted(self.gaps_s, reverse=True)[:max(1, len(self.gaps_s) // 10)]
        return sum(slowest) / len(slowest) if slowest else 0.0


def prompt_of(request: TraceRequest) -> list[int]:
    tokens = [t for h in request.hash_ids for t in block_tokens(h, TRACE_BLOCK)]
    return tokens[:request.input_length] or block_tokens(-1, 8)


async def one(session, url: str, request: TraceRequest, at_s: float, speedup: float, out: Outcome) -> None:
    await asyncio.sleep(max(0.0, at_s - time.monotonic()))
    body = {"model": MODEL, "prompt": prompt_of(request), "max_tokens": max(1, request.output_length),
            "temperature": 0, "ignore_eos": True, "stream": True}
    sent = last = time.monotonic()
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            out.status = response.status
            if response.status != 200:
                return
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                now = time.monotonic()
                if out.ttft_s is None:
                    out.ttft_s = (now - sent) * speedup
                else:
                    out.gaps_s.append((now - last) * speedup)
                last = now
    except (aiohttp.ClientError, asyncio.TimeoutError):
        out.status = -1


async def replay(url: str, trace: list[TraceRequest], rate: float, speedup: float, timeout_s: float) -> list[Outcome]:
    outcomes = [Outcome() for _ in trace]
    start = time.monotonic() + 1.0
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(one(session, url, r, start + r.timestamp_ms / 1000 / rate / speedup, speedup, o)
                               for r, o in zip(trace, outcomes)))
    return outcomes


def figures(outcomes: list[Outcome], duration_s: float) -> dict:
    served = [o for o in outcomes if o.status == 200 and o.ttft_s is not None]
    ttft = sorted(o.ttft_s for o in served) or [0.0]
    good = {f"{t:g}": sum(o.ttft_s <= TTFT_SLO_S and o.tbt_s <= t for o in served) for t in THRESHOLDS_S}
    return {"goodput": {t: n / len(outcomes) for t, n in good.items()},
            "goodput_per_s": {t: n / duration_s for t, n in good.items()},
            "ttft_mean_s": statistics.fmean(ttft), "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "rejected": sum(o.status == 429 for o in outcomes),
            "failed": sum(o.status not in (200, 429) for o in outcomes), "requests": len(outcomes)}


def prediction_ratios(url: str) -> dict:
    """The conductor's histogram of predicted/measured TTFT: its buckets and median."""
    import urllib.request
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    buckets = [(float(line.split('le="')[1].split('"')[0]), float(line.rsplit(" ", 1)[1]))
               for line in text.splitlines() if line.startswith("mooncake_ttft_prediction_ratio_bucket")
               and 'le="+Inf"' not in line]
    total = next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("mooncake_ttft_prediction_ratio_count")), 0.0)
    median = next((le for le, count in buckets if total and count >= total / 2), None)
    return {"count": total, "median_upper_bound": median, "cumulative": dict(buckets)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def live(mode: str, trace, args, rate: float) -> dict:
    colocated = mode == "colocated"
    settings = {
        "engine.model": MODEL, "engine.emulation_speedup": args.speedup, "engine.block_size": 64,
        "engine.prefill_chunk": 512, "engine.max_num_batched_tokens": 512, "engine.max_num_seqs": 256,
        "api.port": 0, "api.model_name": MODEL, "engine.dtype": "float32",
        "conductor.ttft_slo_s": TTFT_SLO_S / args.speedup, "conductor.tbt_slo_s": THRESHOLDS_S[0] / args.speedup,
        "conductor.prefill_timeout_s": 900.0, "conductor.token_timeout_s": 120.0,
        "conductor.mode": mode if colocated else "disaggregated"}
    config = load_config(None, settings)
    workdir = Path(tempfile.mkdtemp(prefix=f"goodput-{mode}-"))
    num_prefill, num_decode = (0, args.prefill + args.decode) if colocated else (args.prefill, args.decode)
    with DevCluster(config, num_prefill, num_decode, 0 if colocated else 1, workdir, log_to_files=True) as cluster:
        before = {p.name: cpu_seconds(p.pid) for p in cluster.processes}
        started = time.monotonic()
        outcomes = asyncio.run(replay(cluster.url, trace, rate, args.speedup, args.timeout))
        wall_s = time.monotonic() - started
        used = {p.name: cpu_seconds(p.pid) - before[p.name] for p in cluster.processes}
        result = figures(outcomes, trace[-1].timestamp_ms / 1000 / rate or 1.0)
        result["prediction_ratio"] = prediction_ratios(cluster.url)
    result["wall_s"] = wall_s
    # NOTE: where the box's CPU went: when it is all used, live timings fall behind the modelled ones.
    result["cpu_s"] = {"conductor": used.get("conductor", 0.0), "all": sum(used.values()),
                       "conductor_ms_per_request": 1e3 * used.get("conductor", 0.0) / len(trace),
                       "box_share": sum(used.values()) / wall_s / os.cpu_count()}
    return result


def simulated(mode: str, trace, args, rate: float) -> dict:
    config = load_config(None, {"sim.mode": "vllm" if mode == "colocated" else "mooncake", "sim.speed": rate,
                                "sim.num_prefill": args.prefill, "sim.num_decode": args.decode,
                                "sim.num_instances": args.prefill + args.decode})
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl") as f:
        for r in trace:
            f.write(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")
        f.flush()
        result = simulate(f.name, config)
    served = result["per_request"]
    ttft = sorted(served["ttft_s"]) or [0.0]
    good = {f"{t:g}": sum(a <= TTFT_SLO_S and b <= t for a, b in zip(served["ttft_s"], served["tbt_s"]))
            for t in THRESHOLDS_S}
    duration = trace[-1].timestamp_ms / 1000 / rate or 1.0
    return {"goodput": {t: n / len(trace) for t, n in good.items()},
            "goodput_per_s": {t: n / duration for t, n in good.items()},
            "ttft_mean_s": statistics.fmean(ttft), "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "rejected": sum(result["rejected"].values()), "failed": 0, "requests": len(trace)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl")
    parser.add_argument("--requests", type=int, default=1000, help="the trace's first N requests")
    parser.add_argument("--prefill", type=int, default=8)
    parser.add_argument("--decode", type=int, default=8)
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0], help="rate factors: trace pace x this")
    parser.add_argument("--speedup", type=float, default=1.0, help="engine.emulation_speedup of the live runs")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a request may take, live")
    parser.add_argument("--quick", action="store_true", help="2P2D vs colocated 4, 40 requests")
    parser.add_argument("--json", type=Path, default=Path("bench-results/goodput.json"))
    args = parser.parse_args()
    if args.quick:
        args.requests, args.prefill, args.decode = min(args.requests, 40), 2, 2
    rng = random.Random(0)
    if args.trace.exists():
        trace = load_trace(args.trace)[:args.requests]
    else:
        print(f"no trace at {args.trace}: replaying synthetic requests")
        trace = synthetic_trace(rng, args.requests)
    results = {"live": {"mooncake": {}, "colocated": {}}, "sim": {"mooncake": {}, "colocated": {}}}
    for rate in args.rates:
        for mode in ("mooncake", "colocated"):
            results["sim"][mode][f"{rate:g}"] = simulated(mode, trace, args, rate)
            results["live"][mode][f"{rate:g}"] = live(mode, trace, args, rate)
    x, y = args.prefill, args.decode
    print(f"{len(trace)} requests, Mooncake {x}P{y}D vs colocated x{x + y}, emulated {MODEL}, speedup {args.speedup:g}")
    print(f"{'rate':>5} {'system':>20} {'good@0.1':>9} {'good@0.2':>9} {'good@0.3':>9} {'TTFT mean':>10} "
          f"{'TTFT p99':>9} {'429':>5} {'failed':>6}")
    for rate in args.rates:
        for where in ("live", "sim"):
            for mode in ("mooncake", "colocated"):
                r = results[where][mode][f"{rate:g}"]
                g = r["goodput"]
                print(f"{rate:>5g} {where + ' ' + mode:>20} {g['0.1']:>9.3f} {g['0.2']:>9.3f} {g['0.3']:>9.3f} "
                      f"{r['ttft_mean_s']:>10.2f} {r['ttft_p99_s']:>9.2f} {r['rejected']:>5} {r['failed']:>6}")
        for mode in ("mooncake", "colocated"):
            cpu = results["live"][mode][f"{rate:g}"]["cpu_s"]
            print(f"  live {mode}: conductor {cpu['conductor_ms_per_request']:.1f} CPU ms per request; every role "
                  f"together used {cpu['box_share']:.0%} of the box's CPUs while replaying")
        ratio = results["live"]["mooncake"][f"{rate:g}"]["prediction_ratio"]
        print(f"  live Mooncake at rate {rate:g}: predicted/measured TTFT of {ratio['count']:.0f} requests, "
              f"median <= {ratio['median_upper_bound']}; cumulative by bucket: {ratio['cumulative']}")
    results["args"] = {k: str(v) for k, v in vars(args).items()}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

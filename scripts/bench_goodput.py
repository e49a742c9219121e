#!/usr/bin/env python3
"""Goodput of the live system against the simulator, on the emulated LLaMA3-70B (DESIGN section 8).

Replays a slice of a Mooncake trace open-loop through the live OpenAI API (an async client sends each
request at its timestamp, divided by the rate factor and the emulation speedup): once against Mooncake
xPyD, once against the colocated baseline of x+y instances on the same emulated hardware; and runs the
simulator on the same slice and configuration. Times measured live are multiplied back by the speedup,
so every figure is in the emulated hardware's seconds. Goodput: the share (and rate) of requests with
TTFT <= 30 s and TBT <= 0.1 / 0.2 / 0.3 s (TBT as the paper: the mean of a request's slowest 10% of gaps).
Also: mean and p99 TTFT (and the mean as the conductor saw it, without the HTTP and SSE legs), rejections
(429), failures, and the live conductor's predicted/measured TTFT. Requests of one trace timestamp are sent
a millisecond apart in trace order, the order the simulator takes them in.

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
import urllib.request
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from chaos import block_tokens, synthetic_trace  # noqa: E402
from mooncake.config import load_config  # noqa: E402
from mooncake.dev import DevCluster  # noqa: E402
from mooncake.sim.plots import pyplot, save_figure  # noqa: E402
from mooncake.sim.run import simulate  # noqa: E402
from mooncake.sim.trace import TraceRequest, load_trace  # noqa: E402

MODEL = "emulated-llama3-70b"
TTFT_SLO_S = 30.0
THRESHOLDS_S = (0.1, 0.2, 0.3)
TRACE_BLOCK = 512  # tokens per hash id in Mooncake traces
BURST_GAP_S = 1e-3  # between two requests sent at one trace timestamp


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


def send_offsets_s(trace: list[TraceRequest], rate: float, speedup: float) -> list[float]:
    """When each request leaves, in seconds from the replay's start: its timestamp over the rate factor and
    the speedup. Requests of one timestamp (the trace's come in bursts) leave BURST_GAP_S apart in trace
    order, the order the simulator takes them in: equal asyncio deadlines fire in any order."""
    offsets, previous, in_burst = [], None, 0
    for r in trace:
        in_burst = in_burst + 1 if r.timestamp_ms == previous else 0
        previous = r.timestamp_ms
        offsets.append(r.timestamp_ms / 1000 / rate / speedup + in_burst * BURST_GAP_S)
    return offsets


async def replay(url: str, trace: list[TraceRequest], rate: float, speedup: float, timeout_s: float) -> list[Outcome]:
    outcomes = [Outcome() for _ in trace]
    start = time.monotonic() + 1.0
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(one(session, url, r, start + at_s, speedup, o)
                               for r, o, at_s in zip(trace, outcomes, send_offsets_s(trace, rate, speedup))))
    return outcomes


def figures(outcomes: list[Outcome], duration_s: float) -> dict:
    served = [o for o in outcomes if o.status == 200 and o.ttft_s is not None]
    ttft = sorted(o.ttft_s for o in served) or [0.0]
    good = {f"{t:g}": sum(o.ttft_s <= TTFT_SLO_S and o.tbt_s <= t for o in served) for t in THRESHOLDS_S}
    return {"goodput": {t: n / len(outcomes) for t, n in good.items()},
            "goodput_per_s": {t: n / duration_s for t, n in good.items()},
            "ttft_mean_s": statistics.fmean(ttft), "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "rejected": sum(o.status == 429 for o in outcomes),
            "failed": sum(o.status not in (200, 429) for o in outcomes), "requests": len(outcomes),
            "ttft_s": [o.ttft_s for o in served]}


def histogram(text: str, name: str, labels: str = "") -> dict:
    """One Prometheus histogram of a /metrics text, by its label set `labels` (e.g. 'role="decode"'):
    count, mean, the upper bounds of the buckets holding its median and 90th percentile, and the
    cumulative count by bucket."""
    def value(line: str) -> float:
        return float(line.rsplit(" ", 1)[1])

    lines = [line for line in text.splitlines() if line.startswith(name) and labels in line]
    buckets = [(float(line.split('le="')[1].split('"')[0]), value(line)) for line in lines
               if line.startswith(name + "_bucket") and 'le="+Inf"' not in line]
    total = next((value(line) for line in lines if line.startswith(name + "_count")), 0.0)
    total_sum = next((value(line) for line in lines if line.startswith(name + "_sum")), 0.0)

    def quantile(q: float):
        return next((le for le, count in buckets if total and count >= q * total), None)

    return {"count": total, "mean": total_sum / total if total else None, "median_upper_bound": quantile(0.5),
            "p90_upper_bound": quantile(0.9), "cumulative": dict(buckets)}


def scrape(url: str) -> str:
    return urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()


def step_ratios(text: str) -> dict:
    """Per role, measured over modelled step time of the emulated instances, and the share of steps
    within 5% of the model."""
    out = {}
    for role in ("prefill", "decode"):
        h = histogram(text, "mooncake_emulated_step_ratio", f'role="{role}"')
        h["within_5pct"] = h["cumulative"].get(1.05, 0.0) / h["count"] if h["count"] else None
        out[role] = h
    return out


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
    with DevCluster(config, num_prefill, num_decode, 0 if colocated else 1, workdir, log_to_files=True,
                    num_api=args.api) as cluster:
        before = {p.name: cpu_seconds(p.pid) for p in cluster.processes}
        started = time.monotonic()
        outcomes = asyncio.run(replay(cluster.url, trace, rate, args.speedup, args.timeout))
        wall_s = time.monotonic() - started
        used = {p.name: cpu_seconds(p.pid) - before[p.name] for p in cluster.processes}
        result = figures(outcomes, trace[-1].timestamp_ms / 1000 / rate or 1.0)
        text = scrape(cluster.url)
        result["prediction_ratio"] = histogram(text, "mooncake_ttft_prediction_ratio")
        # NOTE: from the API process's admission to its first token out: the client's TTFT less the HTTP
        # request, the SSE write and the client's own loop (all on this box's cores too).
        result["conductor_ttft_mean_s"] = (histogram(text, "mooncake_ttft_seconds")["mean"] or 0.0) * args.speedup
        result["step_ratio"] = step_ratios(text)
    result["wall_s"] = wall_s
    # NOTE: where the box's CPU went: when it is all used, live timings fall behind the modelled ones.
    api_s = sum(s for name, s in used.items() if name.startswith("api-"))
    result["cpu_s"] = {"conductor": used.get("conductor", 0.0), "api": api_s, "all": sum(used.values()),
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
            "rejected": sum(result["rejected"].values()), "failed": 0, "requests": len(trace),
            "ttft_s": list(served["ttft_s"])}


def plot(results: dict, rates: list[float], out_dir: Path) -> list[Path]:
    """goodput-vs-rate.png (one panel per TBT threshold, the four systems as lines) and ttft-cdf.png (the
    four systems' TTFT CDFs at each rate)."""
    plt = pyplot()
    systems = [(where, mode) for where in ("live", "sim") for mode in ("mooncake", "colocated")]
    style = {"live": "-", "sim": "--"}
    fig, axes = plt.subplots(1, len(THRESHOLDS_S), figsize=(4 * len(THRESHOLDS_S), 3.5), sharey=True)
    for ax, threshold in zip(axes, THRESHOLDS_S):
        for where, mode in systems:
            ax.plot(rates, [results[where][mode][f"{r:g}"]["goodput_per_s"][f"{threshold:g}"] for r in rates],
                    style[where], marker="o", label=f"{where} {mode}")
        ax.set_title(f"TTFT <= {TTFT_SLO_S:g} s, TBT <= {threshold:g} s", fontsize=9)
        ax.set_xlabel("rate factor (x trace pace)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("goodput (requests/s)")
    axes[0].legend(fontsize=8)
    paths = [save_figure(fig, out_dir / "goodput-vs-rate.png", plt)]
    fig, ax = plt.subplots(figsize=(6, 4))
    for rate in rates:
        for where, mode in systems:
            values = sorted(results[where][mode][f"{rate:g}"]["ttft_s"])
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], style[where],
                        label=f"{where} {mode}" + (f" x{rate:g}" if len(rates) > 1 else ""))
    ax.axvline(TTFT_SLO_S, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("TTFT (s, emulated hardware)")
    ax.set_ylabel("CDF of served requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(save_figure(fig, out_dir / "ttft-cdf.png", plt))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl")
    parser.add_argument("--requests", type=int, default=1000, help="the trace's first N requests")
    parser.add_argument("--prefill", type=int, default=8)
    parser.add_argument("--decode", type=int, default=8)
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0], help="rate factors: trace pace x this")
    parser.add_argument("--speedup", type=float, default=1.0, help="engine.emulation_speedup of the live runs")
    parser.add_argument("--api", type=int, default=1, help="API processes of the live runs (one port)")
    parser.add_argument("--modes", nargs="+", default=["mooncake", "colocated"], choices=["mooncake", "colocated"],
                        help="which systems to run, live and simulated")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a request may take, live")
    parser.add_argument("--quick", action="store_true", help="2P2D vs colocated 4, 40 requests")
    parser.add_argument("--json", type=Path, default=Path("bench-results/goodput.json"),
                        help="where the figures go; the PNG plots go beside it")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNGs (they need matplotlib: "
                        "pip install 'mooncake[sim]')")
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
        for mode in args.modes:
            results["sim"][mode][f"{rate:g}"] = simulated(mode, trace, args, rate)
            results["live"][mode][f"{rate:g}"] = live(mode, trace, args, rate)
    x, y = args.prefill, args.decode
    print(f"{len(trace)} requests, Mooncake {x}P{y}D vs colocated x{x + y}, emulated {MODEL}, speedup {args.speedup:g}")
    print(f"{'rate':>5} {'system':>20} {'good@0.1':>9} {'good@0.2':>9} {'good@0.3':>9} {'TTFT mean':>10} "
          f"{'TTFT p99':>9} {'429':>5} {'failed':>6}")
    for rate in args.rates:
        for where in ("live", "sim"):
            for mode in args.modes:
                r = results[where][mode][f"{rate:g}"]
                g = r["goodput"]
                print(f"{rate:>5g} {where + ' ' + mode:>20} {g['0.1']:>9.3f} {g['0.2']:>9.3f} {g['0.3']:>9.3f} "
                      f"{r['ttft_mean_s']:>10.2f} {r['ttft_p99_s']:>9.2f} {r['rejected']:>5} {r['failed']:>6}")
        for mode in args.modes:
            cpu = results["live"][mode][f"{rate:g}"]["cpu_s"]
            print(f"  live {mode}: conductor {cpu['conductor_ms_per_request']:.1f} CPU ms per request; every role "
                  f"together used {cpu['box_share']:.0%} of the box's CPUs while replaying")
            print(f"  live {mode}: TTFT mean as the API process saw it "
                  f"{results['live'][mode][f'{rate:g}']['conductor_ttft_mean_s']:.2f} s (the client's is above)")
            steps = results["live"][mode][f"{rate:g}"]["step_ratio"]
            print(f"  live {mode}: emulated steps' measured/modelled time, mean by role: "
                  + ", ".join(f"{role} {h['mean']:.3f} ({h['within_5pct']:.0%} within 5%)"
                              for role, h in steps.items() if h["count"]))
        if "mooncake" not in args.modes:
            continue
        ratio = results["live"]["mooncake"][f"{rate:g}"]["prediction_ratio"]
        cum = ratio["cumulative"]
        ratio["within_15pct"] = (cum.get(1.15, 0.0) - cum.get(0.85, 0.0)) / ratio["count"] if ratio["count"] else None
        print(f"  live Mooncake at rate {rate:g}: predicted/measured TTFT of {ratio['count']:.0f} requests, "
              f"median <= {ratio['median_upper_bound']}, {ratio['within_15pct'] or 0:.0%} within 0.85-1.15; "
              f"cumulative by bucket: {ratio['cumulative']}")
    results["args"] = {k: str(v) for k, v in vars(args).items()}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")
    if not args.no_plots and len(args.modes) == 2:
        for path in plot(results, args.rates, args.json.parent):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Goodput and capacity of the live system against the simulator, on the emulated LLaMA3-70B (DESIGN section 8).

Replays a slice of a Mooncake trace open-loop through the live OpenAI API (an async client sends each
request at its timestamp, divided by the rate factor and the emulation speedup): once against Mooncake
xPyD, once against the colocated baseline of x+y instances on the same emulated hardware; and runs the
simulator on the same slice and configuration. Times measured live are multiplied back by the speedup,
so every figure is in the emulated hardware's seconds. Goodput: the share (and rate) of requests with
TTFT <= 30 s and TBT <= 0.1 / 0.2 / 0.3 s (TBT as the paper: the mean of a request's slowest 10% of gaps).
Capacity: the highest rate factor with 90% of requests within both SLOs, bisected (scripts/capacity.py).

Nobody is told output lengths: every request asks a cap (--max-tokens, default the trace's longest
output) and the emulated model ends each answer with EOS at a length drawn from the trace's distribution,
seeded by the prompt (mooncake/answer_lengths.py; the simulator computes the same, and the live run checks
every answer's length against it). The conductor predicts decode work from the lengths it has seen end,
and its estimators start --prior-scale off the truth and learn (the TTFT and TBT prediction ratios are
scraped over time). Steps that mix prefill and decode cost the roofline's larger bound (--cost).
--oracle replays as before, for comparison: max_tokens = the trace's output length with ignore_eos.

Also: mean and p99 TTFT (and the mean as the conductor saw it, without the HTTP and SSE legs), rejections
(429), failures. Requests of one trace timestamp are sent a millisecond apart in trace order, the order
the simulator takes them in.

    .venv/bin/python scripts/bench_goodput.py --quick              # 2P2D vs colocated 4, a small slice
    .venv/bin/python scripts/bench_goodput.py --requests 1000 --prefill 8 --decode 8 --rates 0.75 1 1.25

Writes JSON: live.mooncake, live.colocated, sim.mooncake, sim.colocated (each rate -> figures, with
`prediction`: median predicted/measured TTFT and the share within 0.85-1.15), and capacity[side][system]."""

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from capacity import THRESHOLDS_S, capacity  # noqa: E402
from live_metrics import cpu_seconds, histogram, scrape, step_ratios  # noqa: E402
from chaos import synthetic_trace  # noqa: E402
from mooncake.config import load_config  # noqa: E402
from mooncake.dev import DevCluster  # noqa: E402
from mooncake.sim.plots import pyplot, save_figure  # noqa: E402
from mooncake.sim.metrics import prediction_figures  # noqa: E402
from mooncake.sim.run import simulate_requests  # noqa: E402
from mooncake.sim.trace import TraceRequest, load_trace, trace_prompt, with_emulated_answers  # noqa: E402

MODEL = "emulated-llama3-70b"
TTFT_SLO_S = 30.0
TRACE_BLOCK = 512  # tokens per hash id in Mooncake traces
BURST_GAP_S = 1e-3  # between two requests sent at one trace timestamp


@dataclasses.dataclass
class Outcome:
    status: int = 0
    ttft_s: float | None = None  # emulated seconds
    gaps_s: list = dataclasses.field(default_factory=list)
    tokens: int = 0  # completion tokens, as the final usage chunk says

    @property
    def tbt_s(self) -> float:
        slowest = sorted(self.gaps_s, reverse=True)[:max(1, len(self.gaps_s) // 10)]
        return sum(slowest) / len(slowest) if slowest else 0.0


async def one(session, url: str, request: TraceRequest, at_s: float, speedup: float, out: Outcome,
              cap: int, model: str = MODEL, block: int = TRACE_BLOCK) -> None:
    """One request, sent at `at_s`: max_tokens `cap`, to EOS (the answer's length is nobody's to tell), or
    with cap 0 the trace's output length with ignore_eos (the oracle)."""
    await asyncio.sleep(max(0.0, at_s - time.monotonic()))
    body = {"model": model, "prompt": trace_prompt(request.hash_ids, block, request.input_length),
            "max_tokens": cap or max(1, request.output_length), "temperature": 0, "ignore_eos": not cap,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = last = time.monotonic()
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            out.status = response.status
            if response.status != 200:
                return
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                if b'"usage"' in line:  # the usage chunk, after the last token
                    out.tokens = json.loads(line[6:])["usage"]["completion_tokens"]
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


async def replay(url: str, trace: list[TraceRequest], rate: float, speedup: float, timeout_s: float,
                 cap: int, model: str = MODEL, block: int = TRACE_BLOCK) -> list[Outcome]:
    outcomes = [Outcome() for _ in trace]
    start = time.monotonic() + 1.0
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(one(session, url, r, start + at_s, speedup, o, cap, model, block)
                               for r, o, at_s in zip(trace, outcomes, send_offsets_s(trace, rate, speedup))))
    return outcomes


def figures(outcomes: list[Outcome], duration_s: float, slo_scale: tuple[float, float] = (1.0, 1.0)) -> dict:
    """Goodput keyed by the paper's TBT thresholds; `slo_scale` (TTFT's, TBT's) multiplies the SLOs (--real)."""
    served = [o for o in outcomes if o.status == 200 and o.ttft_s is not None]
    ttft = sorted(o.ttft_s for o in served) or [0.0]
    good = {f"{t:g}": sum(o.ttft_s <= TTFT_SLO_S * slo_scale[0] and o.tbt_s <= t * slo_scale[1] for o in served)
            for t in THRESHOLDS_S}
    return {"goodput": {t: n / len(outcomes) for t, n in good.items()},
            "goodput_per_s": {t: n / duration_s for t, n in good.items()},
            "ttft_mean_s": statistics.fmean(ttft), "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "rejected": sum(o.status == 429 for o in outcomes),
            "failed": sum(o.status not in (200, 429) for o in outcomes), "requests": len(outcomes),
            "ttft_s": [o.ttft_s for o in served]}


class PredictionWatch:
    """Scrapes the live conductor's predicted/measured histograms every `every_s` while a replay runs, so
    the figures of each window show how the estimators converge from their prior."""

    NAMES = {"ttft": "mooncake_ttft_prediction_ratio", "tbt": "mooncake_tbt_prediction_ratio"}

    def __init__(self, url: str, every_s: float):
        self.url, self.every_s = url, every_s
        self.samples: list[tuple[float, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = time.monotonic()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=30)
        self._take()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._take()

    def _take(self) -> None:
        try:
            text = scrape(self.url)
        except OSError:
            return
        hists = {k: histogram(text, name) for k, name in self.NAMES.items()}
        # NOTE: the count, +Inf included, under the key inf (the cumulative buckets leave +Inf out)
        self.samples.append((time.monotonic() - self._started,
                             {k: {**h["cumulative"], float("inf"): h["count"]} for k, h in hists.items()}))

    def windows(self, speedup: float, rows: int = 12) -> list[dict]:
        """Windows between scrapes (until_s: emulated seconds from the replay's start), each holding about
        1/rows of the requests that ended, and per histogram: how many ended in it, their median ratio's
        bucket bound and the share within 0.85-1.15."""
        final = self.samples[-1][1]["ttft"] if self.samples else {}
        least = max(1.0, final.get(float("inf"), 0.0) / rows)
        out, previous = [], {k: {} for k in self.NAMES}
        for n, (t, cumulative) in enumerate(self.samples):
            ended = cumulative["ttft"][float("inf")] - previous["ttft"].get(float("inf"), 0.0)
            if ended < least and n < len(self.samples) - 1:
                continue
            row = {"until_s": round(t * speedup, 1)}
            for k, now in cumulative.items():
                delta = {le: count - previous[k].get(le, 0.0) for le, count in now.items()}
                total = delta[float("inf")]
                row[k] = {"count": total, "median_upper_bound": next(
                    (le for le, c in sorted(delta.items()) if total and c >= total / 2), None),
                    "share_0.85_1.15": (delta.get(1.15, 0.0) - delta.get(0.85, 0.0)) / total if total else None}
            previous = cumulative
            out.append(row)
        return out


def live(mode: str, trace, args, rate: float) -> dict:
    colocated = mode == "colocated"
    settings = {
        "engine.emulation_step_model": args.cost, "conductor.estimator_prior_scale": args.prior_scale,
        "conductor.output_lengths": "max_tokens" if args.oracle else "learned",
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
        with PredictionWatch(cluster.url, args.scrape_every) as watch:
            outcomes = asyncio.run(replay(cluster.url, trace, rate, args.speedup, args.timeout,
                                          0 if args.oracle else args.max_tokens))
        wall_s = time.monotonic() - started
        used = {p.name: cpu_seconds(p.pid) - before[p.name] for p in cluster.processes}
        result = figures(outcomes, trace[-1].timestamp_ms / 1000 / rate or 1.0)
        text = scrape(cluster.url)
        result["prediction_ratio"] = histogram(text, "mooncake_ttft_prediction_ratio")
        result["prediction"] = bucket_prediction(result["prediction_ratio"])
        result["prediction_over_time"] = watch.windows(args.speedup)
        # NOTE: every answer as long as the simulator computes it (trace output lengths under the oracle)
        result["answers_as_simulated"] = sum(o.tokens == r.output_length for o, r in zip(outcomes, trace)
                                             if o.status == 200) / max(1, sum(o.status == 200 for o in outcomes))
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


def bucket_prediction(h: dict) -> dict:
    """`prediction` of a live ratio histogram: the median's bucket bound and the share within 0.85-1.15."""
    cum, count = h["cumulative"], h["count"]
    return {"median_ratio": h["median_upper_bound"], "count": count,
            "share_0.85_1.15": (cum.get(1.15, 0.0) - cum.get(0.85, 0.0)) / count if count else None}


def simulated(mode: str, trace, args, rate: float) -> dict:
    """The simulator on `trace`, whose output lengths are what each request writes (with_emulated_answers
    applied unless --oracle)."""
    config = load_config(None, {"sim.mode": "vllm" if mode == "colocated" else "mooncake", "sim.speed": rate,
                                "sim.num_prefill": args.prefill, "sim.num_decode": args.decode,
                                "sim.num_instances": args.prefill + args.decode, "sim.step_model": args.cost,
                                "sim.max_tokens": 0 if args.oracle else args.max_tokens,
                                "conductor.estimator_prior_scale": args.prior_scale,
                                "conductor.output_lengths": "max_tokens" if args.oracle else "learned"})
    return simulated_figures(trace, config, rate)


def simulated_figures(trace, config, rate: float, slo_scale: tuple[float, float] = (1.0, 1.0)) -> dict:
    result = simulate_requests(trace, config)
    served = result["per_request"]
    ttft = sorted(served["ttft_s"]) or [0.0]
    good = {f"{t:g}": sum(a <= TTFT_SLO_S * slo_scale[0] and b <= t * slo_scale[1]
                          for a, b in zip(served["ttft_s"], served["tbt_s"])) for t in THRESHOLDS_S}
    duration = trace[-1].timestamp_ms / 1000 / rate or 1.0
    return {"goodput": {t: n / len(trace) for t, n in good.items()},
            "goodput_per_s": {t: n / duration for t, n in good.items()},
            "ttft_mean_s": statistics.fmean(ttft), "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "rejected": sum(result["rejected"].values()), "failed": 0, "requests": len(trace),
            "ttft_s": list(served["ttft_s"]), "prediction": result["prediction"]}


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
    import goodput_real  # NOTE: here, not above: it imports this module
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
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="max_tokens every request asks (a cap; each answer ends with EOS at its own length, "
                             "which nobody is told); default: the trace's longest output")
    parser.add_argument("--oracle", action="store_true",
                        help="the old replay, for comparison only: max_tokens = the trace's output length with "
                             "ignore_eos, and the conductor predicts decode work from it")
    parser.add_argument("--cost", choices=["roofline", "additive"],
                        help="how a step mixing prefill and decode is charged, live and simulated (mooncake/cost.py); "
                             "default roofline, and with --real the step model the profile's fit chose")
    parser.add_argument("--prior-scale", type=float, default=2.0,
                        help="conductor.estimator_prior_scale: the estimators start this far off and learn")
    parser.add_argument("--capacity", choices=["none", "sim", "both"], default="sim",
                        help="bisect the highest rate at which 90%% of requests meet both SLOs: in the "
                             "simulator, or live too (a live replay per step); --quick: both")
    parser.add_argument("--capacity-steps", type=int, default=5, help="bisection steps after bracketing")
    parser.add_argument("--live-capacity-steps", type=int, default=2,
                        help="bisection steps of the live search (it starts at the simulator's capacity and "
                             "brackets in at most 3 replays)")
    parser.add_argument("--scrape-every", type=float, default=5.0,
                        help="seconds between scrapes of the live conductor's prediction histograms")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a request may take, live")
    parser.add_argument("--quick", action="store_true", help="2P2D vs colocated 4, 40 requests")
    parser.add_argument("--sim-only", action="store_true", help="the simulator's side only (no live cluster)")
    parser.add_argument("--json", type=Path, default=Path("bench-results/goodput.json"),
                        help="where the figures go; the PNG plots go beside it")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNGs (they need matplotlib: "
                        "pip install 'mooncake[sim]')")
    goodput_real.add_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.prefill, args.decode = min(args.requests, 40), 2, 2
        args.capacity = "both" if args.capacity == "sim" else args.capacity
        args.live_capacity_steps = min(args.live_capacity_steps, 1)
    rng = random.Random(0)
    if args.trace.exists():
        whole = load_trace(args.trace)
        trace = whole[:args.requests]
    else:
        print(f"no trace at {args.trace}: replaying synthetic requests")
        whole = trace = synthetic_trace(rng, args.requests)
    if args.real:
        return goodput_real.run(args, whole)
    args.cost = args.cost or "roofline"
    args.max_tokens = args.max_tokens or max(r.output_length for r in whole)
    # What each request writes: the emulated model's answer to its prompt under the cap (the oracle: the trace's).
    answered = trace if args.oracle else with_emulated_answers(trace, args.max_tokens, TRACE_BLOCK)
    results = {"live": {"mooncake": {}, "colocated": {}}, "sim": {"mooncake": {}, "colocated": {}}}
    for rate in args.rates:
        for mode in args.modes:
            results["sim"][mode][f"{rate:g}"] = simulated(mode, answered, args, rate)
            if not args.sim_only:
                results["live"][mode][f"{rate:g}"] = live(mode, answered, args, rate)
    if args.capacity != "none":
        results["capacity"] = capacities(answered, args)
    report(results, trace, answered, args)
    results["args"] = {k: str(v) for k, v in vars(args).items()}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")
    if not args.no_plots and len(args.modes) == 2 and not args.sim_only:
        for path in plot(results, args.rates, args.json.parent):
            print(f"wrote {path}")


def capacities(answered, args) -> dict:
    """capacity[side][system][threshold] (rate factor), and per side Mooncake's over colocated's, less 1."""
    sides = {"sim": simulated} if args.capacity == "sim" or args.sim_only else {"sim": simulated, "live": live}
    out = {}
    for side, run in sides.items():
        out[side] = {}
        for mode in args.modes:
            def share_within(rate: float, run=run, mode=mode) -> dict:
                figures = run(mode, answered, args, rate)
                print(f"  capacity search, {side} {mode} at rate {rate:.3g}: within SLOs "
                      + ", ".join(f"TBT {t} s {v:.0%}" for t, v in figures["goodput"].items()), flush=True)
                return figures["goodput"]
            # NOTE: live starts each search where the simulator's ended: a live replay per step is dear
            start = {t: c["rate"] for t, c in out["sim"][mode].items() if c["rate"]} if side == "live" else {}
            out[side][mode] = capacity(share_within, start=start, steps=args.capacity_steps if side == "sim" else
                                       args.live_capacity_steps, brackets=8 if side == "sim" else 3)
        if len(args.modes) == 2:
            out[side]["mooncake_over_colocated"] = {
                t: (c["rate"] / out[side]["colocated"][t]["rate"] - 1) if out[side]["colocated"][t]["rate"] else None
                for t, c in out[side]["mooncake"].items()}
    return out


def report(results: dict, trace, answered, args) -> None:
    x, y = args.prefill, args.decode
    lengths = sorted(r.output_length for r in answered)
    how = ("ORACLE: max_tokens = the trace's output length, ignore_eos" if args.oracle else
           f"max_tokens {args.max_tokens}, answers end with EOS (median {lengths[len(lengths) // 2]} tokens)")
    print(f"{len(trace)} requests, Mooncake {x}P{y}D vs colocated x{x + y}, emulated {MODEL}, speedup "
          f"{args.speedup:g}; {how}; {args.cost} step cost; estimator prior x{args.prior_scale:g}")
    print(f"{'rate':>5} {'system':>20} {'good@0.1':>9} {'good@0.2':>9} {'good@0.3':>9} {'TTFT mean':>10} "
          f"{'TTFT p99':>9} {'429':>5} {'failed':>6} {'pred. median':>12} {'0.85-1.15':>9}")
    for rate in args.rates:
        for where in ("sim",) if args.sim_only else ("live", "sim"):
            for mode in args.modes:
                r = results[where][mode][f"{rate:g}"]
                g, p = r["goodput"], r["prediction"]
                median = "-" if p["median_ratio"] is None else f"{p['median_ratio']:.3g}"
                share = "-" if p["share_0.85_1.15"] is None else f"{p['share_0.85_1.15']:.0%}"
                print(f"{rate:>5g} {where + ' ' + mode:>20} {g['0.1']:>9.3f} {g['0.2']:>9.3f} {g['0.3']:>9.3f} "
                      f"{r['ttft_mean_s']:>10.2f} {r['ttft_p99_s']:>9.2f} {r['rejected']:>5} {r['failed']:>6} "
                      f"{median:>12} {share:>9}")
        for mode in () if args.sim_only else args.modes:
            r = results["live"][mode][f"{rate:g}"]
            cpu = r["cpu_s"]
            print(f"  live {mode}: conductor {cpu['conductor_ms_per_request']:.1f} CPU ms per request; every role "
                  f"together used {cpu['box_share']:.0%} of the box's CPUs while replaying; "
                  f"{r['answers_as_simulated']:.0%} of answers as long as the simulator computes")
            print(f"  live {mode}: TTFT mean as the API process saw it {r['conductor_ttft_mean_s']:.2f} s "
                  f"(the client's is above)")
            print(f"  live {mode}: emulated steps' measured/modelled time, mean by role: "
                  + ", ".join(f"{role} {h['mean']:.3f} ({h['within_5pct']:.0%} within 5%)"
                              for role, h in r["step_ratio"].items() if h["count"]))
        if "mooncake" in args.modes and not args.sim_only:
            print(f"  live Mooncake at rate {rate:g}, predicted/measured over time (emulated s: requests ended, median "
                  "bucket, share within 0.85-1.15; TTFT | TBT):")
            for w in results["live"]["mooncake"][f"{rate:g}"]["prediction_over_time"]:
                if w["ttft"]["count"] or w["tbt"]["count"]:
                    print(f"    until {w['until_s']:>8.1f} s: " + " | ".join(
                        f"{w[k]['count']:.0f}, {w[k]['median_upper_bound']}, "
                        + ("-" if w[k]["share_0.85_1.15"] is None else f"{w[k]['share_0.85_1.15']:.0%}")
                        for k in ("ttft", "tbt")))
    for side, systems in results.get("capacity", {}).items():
        for mode in args.modes:
            print(f"  capacity ({side} {mode}), highest rate factor with 90% within both SLOs: " + ", ".join(
                f"TBT {t} s: {c['rate']:.3g}{'' if c['bound'] == 'bisected' else ' (' + c['bound'] + ')'}"
                for t, c in systems[mode].items()))
        if "mooncake_over_colocated" in systems:
            over = systems["mooncake_over_colocated"]
            print(f"  capacity ({side}) Mooncake over colocated: " + ", ".join(
                f"TBT {t} s: {'-' if v is None else f'{v:+.0%}'}" for t, v in over.items())
                + " (the paper, conversation trace: +498% / +157% / +59%)")


if __name__ == "__main__":
    main()

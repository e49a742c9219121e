"""`bench_goodput.py --real`: a check on real compute that shares nothing with the emulated cost model.

This box's CPU cores play the accelerators: SmolLM2 (float32, one torch thread per instance) runs as Mooncake
1P1D against colocated x2, each instance pinned to its own core (every thread of its process); the conductor,
API process, cache node and client take what is left, and their CPU is measured and printed. Each request of a
conversation-trace slice is scaled to fit the model's context: its prompt is --scale of the trace's length
(a trace block of 512 tokens becomes one KV block of 64), its answer ends with EOS or at --real-max-tokens
(nobody is told its length). Real prefill/decode interference, real memory-bandwidth contention.

Beside each live run, the simulator replays the same requests (prompt lengths, shared prefixes, and the
answer lengths the live run wrote) with the cost model that scripts/profile_engine.py fitted to this engine on
one core, under the step model its fit chose (or --cost): the simulator's error against the real cluster is
part of the result.

SLOs are the paper's (TTFT 30 s; TBT 0.1 / 0.2 / 0.3 s) as the same multiple of the same work's time on
this core as on the paper's testbed (`slo_scale`): TTFT's by the median prompt's prefill (scaled here, the
trace's there), TBT's by a decode step of one request at that context. Figures keep the paper's labels."""

import ast
import asyncio
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from bench_goodput import (ROOT, THRESHOLDS_S, TTFT_SLO_S, bucket_prediction, figures,  # noqa: E402
                           replay, simulated_figures)
from capacity import capacity  # noqa: E402
from live_metrics import cpu_seconds, histogram, scrape  # noqa: E402
from mooncake.config import load_config  # noqa: E402
from mooncake.cost import CostModel  # noqa: E402
from mooncake.dev import DevCluster  # noqa: E402
from mooncake.sim.run import sim_cost  # noqa: E402
from mooncake.sim.trace import TraceRequest  # noqa: E402

MODEL = "smollm2-135m-instruct"
BLOCK = 64  # tokens per KV block, and per scaled trace block
CORES = {"mooncake": {"prefill-0": 0, "decode-0": 1}, "colocated": {"decode-0": 0, "decode-1": 1}}


def add_arguments(parser) -> None:
    parser.add_argument("--real", action="store_true", help="SmolLM2 on this box's cores, 1P1D vs colocated x2, "
                        "each instance pinned to its own core, beside the simulator with a fitted cost model "
                        "(scripts/goodput_real.py; --rates are the trace's pace x this)")
    parser.add_argument("--profile", type=Path, default=Path("bench-results/profile-smollm2.toml"),
                        help="--real: the [cost] table scripts/profile_engine.py fitted (made first if missing)")
    parser.add_argument("--real-requests", type=int, default=60, help="--real: the trace's first N requests")
    parser.add_argument("--real-max-tokens", type=int, default=128, help="--real: max_tokens of every request")
    parser.add_argument("--scale", type=float, default=BLOCK / 512, help="--real: prompt length x this")
    parser.add_argument("--replay-live", type=Path, metavar="JSON",
                        help="--real: take the live runs (and their SLOs) from this earlier --real JSON, of the same "
                             "requests and rates, instead of running them: the simulator, with --profile's fits, "
                             "against a recorded cluster")


def scaled(trace: list[TraceRequest], scale: float, context: int, cap: int) -> list[TraceRequest]:
    """Each request's prompt at `scale` of its length, within `context` less `cap`: its first hash ids, one per
    BLOCK tokens (at the default scale a trace block of 512 tokens becomes one KV block, and prefixes stay
    shared as in the trace)."""
    out = []
    for r in trace:
        n = max(BLOCK, min(context - cap, round(r.input_length * scale)))
        out.append(dataclasses.replace(r, input_length=n, hash_ids=r.hash_ids[:math.ceil(n / BLOCK)]))
    return out


def slo_scale(real: CostModel, scaled_trace: list[TraceRequest], trace: list[TraceRequest]) -> tuple[float, float]:
    """(TTFT's, TBT's) multipliers of the paper's SLOs: this core's time for the median request's work over the
    paper's testbed's (the simulator's default cost model) for its unscaled work."""
    paper = sim_cost(load_config(None, {}).sim)
    here = sorted(r.input_length for r in scaled_trace)[len(scaled_trace) // 2]
    there = sorted(r.input_length for r in trace)[len(trace) // 2]
    return (real.prefill_s(here) / paper.prefill_s(there), real.step_s([], 1, here) / paper.step_s([], 1, there))


def pin(pid: int, core: int) -> None:
    """Every thread of process `pid` (and those it starts later) on `core` alone."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except (ProcessLookupError, PermissionError):
            pass


def live(mode: str, trace, args, rate: float, cost: CostModel) -> dict:
    prefill, decode = (cost.prefill_coefficients(), cost.decode_coefficients())
    settings = {
        "engine.model": MODEL, "engine.dtype": "float32", "engine.num_threads": 1, "engine.block_size": BLOCK,
        "engine.prefill_chunk": 512, "engine.max_num_batched_tokens": 512, "engine.max_num_seqs": 64,
        "api.port": 0, "api.model_name": MODEL, "conductor.ttft_slo_s": TTFT_SLO_S * args.slo_scale[0],
        "conductor.tbt_slo_s": THRESHOLDS_S[0] * args.slo_scale[1], "conductor.estimator_prior_scale": args.prior_scale,
        # NOTE: the conductor's seeds are the fitted model's, as an emulated instance's Register seeds are its own
        "conductor.prefill_c0_s": prefill[0], "conductor.prefill_s_per_token": prefill[1],
        "conductor.prefill_s_per_token2": prefill[2], "conductor.decode_step_s": decode[0],
        "conductor.decode_s_per_seq": decode[1], "conductor.decode_s_per_context_token": decode[2],
        "conductor.prefill_timeout_s": 900.0, "conductor.token_timeout_s": 120.0,
        "conductor.mode": "colocated" if mode == "colocated" else "disaggregated"}
    config = load_config(None, settings)
    workdir = Path(tempfile.mkdtemp(prefix=f"goodput-real-{mode}-"))
    num_prefill, num_decode = (0, 2) if mode == "colocated" else (1, 1)
    with DevCluster(config, num_prefill, num_decode, 0 if mode == "colocated" else 1, workdir,
                    log_to_files=True) as cluster:
        for proc in cluster.processes:
            if (core := CORES[mode].get(proc.name)) is not None:
                pin(proc.pid, core)
        before = {p.name: cpu_seconds(p.pid) for p in cluster.processes}
        started = time.monotonic()
        outcomes = asyncio.run(replay(cluster.url, trace, rate, 1.0, args.timeout, args.real_max_tokens, MODEL,
                                      BLOCK))
        wall_s = time.monotonic() - started
        used = {p.name: cpu_seconds(p.pid) - before[p.name] for p in cluster.processes}
        result = figures(outcomes, trace[-1].timestamp_ms / 1000 / rate or 1.0, args.slo_scale)
        result["prediction"] = bucket_prediction(histogram(scrape(cluster.url), "mooncake_ttft_prediction_ratio"))
    result["tokens"] = [o.tokens if o.status == 200 else 0 for o in outcomes]
    result["wall_s"] = wall_s
    # NOTE: what each pinned instance used of its core, and what the rest (unpinned) took from both
    pinned = set(CORES[mode])
    result["cpu"] = {"instances_core_share": {n: round(s / wall_s, 3) for n, s in used.items() if n in pinned},
                     "others_cores": round(sum(s for n, s in used.items() if n not in pinned) / wall_s, 3)}
    return result


def simulated(mode: str, trace, args, rate: float, profile: Path | None = None, step_model: str | None = None) -> dict:
    """The simulator's figures for this replay, with the profile's [cost] table (or `profile`'s) under
    --cost (or `step_model`)."""
    config = load_config(None, {"sim.mode": "vllm" if mode == "colocated" else "mooncake", "sim.speed": rate,
                                "sim.num_prefill": 1, "sim.num_decode": 1, "sim.num_instances": 2,
                                "sim.block_tokens": BLOCK, "sim.chunk_tokens": 512,
                                "sim.step_model": step_model or args.cost,
                                "sim.cost_file": str(profile or args.profile), "sim.max_tokens": args.real_max_tokens,
                                "sim.decode_kv_tokens": args.kv_tokens,
                                "sim.vllm_cache_blocks": args.kv_tokens // BLOCK,
                                "conductor.estimator_prior_scale": args.prior_scale,
                                "conductor.output_lengths": "learned",
                                "conductor.ttft_slo_s": TTFT_SLO_S * args.slo_scale[0],
                                "conductor.tbt_slo_s": THRESHOLDS_S[0] * args.slo_scale[1]})
    return simulated_figures(trace, config, rate, args.slo_scale)


def ensure_profile(path: Path) -> None:
    if not path.exists():
        print(f"no fitted cost model at {path}: profiling the engine first (scripts/profile_engine.py)", flush=True)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_engine.py"), "--out", str(path)], check=True)


def run(args, whole: list[TraceRequest]) -> None:
    ensure_profile(args.profile)
    profile = tomllib.loads(args.profile.read_text())
    cost = CostModel.from_dict(profile["cost"], str(args.profile))
    if args.cost and args.cost != cost.step_model:
        raise SystemExit(f"--cost {args.cost}: with --real each fit is simulated under the step model it was fitted "
                         f"for ({args.profile} holds a {cost.step_model} fit; profile_engine.py --step-model "
                         f"picks one)")
    args.cost = cost.step_model
    # the profile's fit under the other step model: the simulator replays each live run with it too
    others = {}
    for name, table in profile.get("other_fits", {}).items():
        others[name] = Path(tempfile.mkdtemp(prefix="goodput-real-fit-")) / f"{name}.toml"
        others[name].write_text("[cost]\n" + "".join(f"{k} = {v!r}\n" for k, v in table.items()))
    args.kv_tokens = int((1 << 30) / cost.kv_bytes_per_token)  # engine.kv_cache_bytes, the default 1 GiB
    trace = scaled(whole[:args.real_requests], args.scale, 8192, args.real_max_tokens)
    args.slo_scale = slo_scale(cost, trace, whole[:args.real_requests])
    recorded = _recorded(args) if args.replay_live else None
    results = {"live": {"mooncake": {}, "colocated": {}}, "sim": {"mooncake": {}, "colocated": {}},
               "slo_scale": args.slo_scale}
    for rate in args.rates:
        for mode in args.modes:
            got = recorded[mode][f"{rate:g}"] if recorded else live(mode, trace, args, rate, cost)
            results["live"][mode][f"{rate:g}"] = got
            # NOTE: the simulator gets the answer lengths this live run wrote (the same greedy answers each time)
            answered = [dataclasses.replace(r, output_length=max(1, n)) for r, n in zip(trace, got["tokens"])]
            sims = {args.cost: simulated(mode, answered, args, rate)}
            sims.update({name: simulated(mode, answered, args, rate, path, name) for name, path in others.items()})
            for name, sim in sims.items():
                sim["error"] = {"ttft_mean": sim["ttft_mean_s"] / max(1e-9, got["ttft_mean_s"]),
                                **{f"goodput_{t}": sim["goodput"][t] - got["goodput"][t] for t in sim["goodput"]}}
                side = results["sim"] if name == args.cost else results.setdefault("sim_other_fits", {}).setdefault(
                    name, {"mooncake": {}, "colocated": {}})
                side[mode][f"{rate:g}"] = sim
            print(f"rate {rate:g} {mode}: live good@0.1/0.2/0.3 "
                  + " / ".join(f"{v:.2f}" for v in got["goodput"].values())
                  + f", TTFT mean {got['ttft_mean_s']:.2f} s; "
                  + "; ".join(f"sim ({name} fit) " + " / ".join(f"{v:.2f}" for v in sim["goodput"].values())
                              + f", TTFT mean {sim['ttft_mean_s']:.2f} s" for name, sim in sims.items())
                  + f"; CPU {got['cpu']}", flush=True)
    results["capacity"] = {"sim": {}}
    answered = [dataclasses.replace(r, output_length=max(1, n)) for r, n in
                zip(trace, results["live"][args.modes[0]][f"{args.rates[0]:g}"]["tokens"])]
    for mode in args.modes:
        def share_within(rate: float, mode=mode) -> dict:
            return simulated(mode, answered, args, rate)["goodput"]
        results["capacity"]["sim"][mode] = capacity(share_within, steps=args.capacity_steps)
    report(results, trace, args)
    out = args.json if str(args.json) != "bench-results/goodput.json" else Path("bench-results/goodput-real.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"real": results, "cost": dataclasses.asdict(cost),
                               "args": {k: str(v) for k, v in vars(args).items()}}, indent=2))
    print(f"wrote {out}")


def _recorded(args) -> dict:
    """The live runs of --replay-live's JSON, whose SLO scale replaces this run's (its goodput was counted
    under it); a rate or system it lacks, or another number of requests, is an error naming it."""
    where = args.replay_live
    try:
        real = json.loads(where.read_text())["real"]
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"--replay-live {where}: not a --real JSON ({exc})") from None
    for mode in args.modes:
        for rate in args.rates:
            got = real["live"].get(mode, {}).get(f"{rate:g}")
            if got is None or len(got["tokens"]) != args.real_requests:
                raise SystemExit(f"--replay-live {where}: no live run of {mode} at rate {rate:g} with "
                                 f"{args.real_requests} requests")
    # NOTE: older files keep it only among their arguments, as text
    args.slo_scale = tuple(real.get("slo_scale")
                           or ast.literal_eval(json.loads(where.read_text())["args"]["slo_scale"]))
    return real["live"]


def report(results: dict, trace, args) -> None:
    lengths = sorted(r.input_length for r in trace)
    print(f"\n--real: {len(trace)} requests, {MODEL} float32, 1P1D vs colocated x2 on cores 0 and 1; prompts "
          f"x{args.scale:g} (median {lengths[len(lengths) // 2]} tokens), max_tokens {args.real_max_tokens}")
    ttft_x, tbt_x = args.slo_scale
    print(f"SLOs scaled to this core's speed: TTFT {TTFT_SLO_S * ttft_x:.1f} s, TBT "
          + " / ".join(f"{t * tbt_x:.3g}" for t in THRESHOLDS_S) + " s (columns keep the paper's labels)")
    print(f"{'rate':>5} {'system':<10} {'side':<19} {'good@0.1':>8} {'good@0.2':>8} {'good@0.3':>8} "
          f"{'TTFT mean':>9} {'429':>4} {'failed':>6}")
    sides = {"live": results["live"], f"sim, {args.cost} fit": results["sim"],
             **{f"sim, {name} fit": other for name, other in results.get("sim_other_fits", {}).items()}}
    for rate in args.rates:
        for mode in args.modes:
            for side, by_mode in sides.items():
                r = by_mode[mode][f"{rate:g}"]
                g = r["goodput"]
                print(f"{rate:5g} {mode:<10} {side:<19} {g['0.1']:8.3f} {g['0.2']:8.3f} {g['0.3']:8.3f} "
                      f"{r['ttft_mean_s']:9.2f} {r['rejected']:4d} {r['failed']:6d}")
    cap = results["capacity"]["sim"]
    if len(args.modes) == 2:
        print("simulated capacity (fitted cost model), Mooncake / colocated rate factor: " + ", ".join(
            f"TBT {t} s {cap['mooncake'][t]['rate']:.3g} / {cap['colocated'][t]['rate']:.3g}" for t in cap["mooncake"]))

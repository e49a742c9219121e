#!/usr/bin/env python3
"""Profiles the real engine on one CPU core and fits the cost model (mooncake/cost.py) to what it measured,
so that the simulator can predict a cluster of such cores (`bench_goodput.py --real` tests that prediction).

Measured, pinned to `--core` with one torch thread: a whole prefill of n tokens (in the live cluster's
chunks), a decode step at batch B over C tokens of context per row, and a mixed step: those B decode rows
beside a new prompt's first chunk. Fitted, the prefill first, then the decode step under each step model:
- prefill: t(n) = c1*n + c2*n^2 by least squares through the origin; the cost model's FLOPs per token come
  from the model's shape (b: its dense matmul FLOPs per token and layer over d_model^2), so c1 gives the
  core's achieved FLOP/s and c2 the attention coefficient a;
- "roofline": t = overhead + max(compute, memory), compute from the prefill's FLOP/s, memory the weights and
  the KV read at a fitted bandwidth; the overhead and the bandwidth minimise the relative error;
- "additive": t = A + B*batch + C*context (linear, the conductor's DecodeStepModel form; a mixed step adds
  its chunk's prefill time), by least squares in relative error: the KV read at C's rate, B per row
  (`decode_row_s`), A the weights' read at that rate plus the overhead.
The mixed steps are fitted by neither: they test which model prices a step that mixes prefill and decode
on this core. `--step-model` picks the table written; by default the one with the smaller error over
every point. Every point's measured and fitted time under both is printed and written (the error is part of
the result). Writes a TOML [cost] table that `sim.cost_file` reads, and JSON beside it."""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mooncake.config import EngineConfig  # noqa: E402
from mooncake.cost import CostModel  # noqa: E402
from mooncake.env import offline_hub  # noqa: E402


def shape_of(config: dict, dtype_bytes: int = 4) -> dict:
    """The cost model's shape fields of a Hugging Face LLaMA-style config (weights at `dtype_bytes`)."""
    h, layers, inter = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // heads
    dense_per_token = 2 * (h * (heads + 2 * kv_heads) * d + heads * d * h + 3 * h * inter)  # per layer
    params = layers * (h * (heads + 2 * kv_heads) * d + heads * d * h + 3 * h * inter + 2 * h)
    params += config["vocab_size"] * h * (1 if config.get("tie_word_embeddings", True) else 2)
    return {"layers": layers, "d_model": h, "b": dense_per_token / h ** 2, "gpus_per_node": 1,
            "kv_bytes_per_token": layers * 2 * kv_heads * d * dtype_bytes, "weight_bytes": float(params * dtype_bytes),
            "activation_bytes_per_token": h * dtype_bytes}


def fit_prefill(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(c1, c2) of t = c1*n + c2*n^2, least squares through the origin (c2 at least 0)."""
    s11 = sum(n ** 2 for n, _ in points)
    s12 = sum(n ** 3 for n, _ in points)
    s22 = sum(n ** 4 for n, _ in points)
    y1 = sum(n * t for n, t in points)
    y2 = sum(n * n * t for n, t in points)
    det = s11 * s22 - s12 * s12
    c1, c2 = (y1 * s22 - y2 * s12) / det, (s11 * y2 - s12 * y1) / det
    if c2 < 0:
        c1, c2 = y1 / s11, 0.0
    return c1, c2


def fit_decode(shape: dict, flops: float, a: float, points: list[tuple[int, int, float]]) -> dict:
    """The bandwidth and per-step overhead that fit decode steps (batch, context per row, seconds) best, in
    relative error, under the roofline step with the prefill's FLOP/s."""
    def error_at(bandwidth: float) -> tuple[float, float, float]:
        model = CostModel(**shape, a=a, gpu_flops=flops, mfu=1.0, hbm_bytes_per_s=bandwidth, decode_efficiency=1.0,
                          decode_overhead_s=0.0)
        bare = [model.step_s([], batch, batch * context) for batch, context, _ in points]
        # NOTE: the overhead that minimises the relative squared error, given the bandwidth, and not below 0
        num = sum((t - m) / t ** 2 for (_, _, t), m in zip(points, bare))
        overhead = max(0.0, num / sum(1 / t ** 2 for _, _, t in points))
        return sum(((m + overhead) / t - 1) ** 2 for (_, _, t), m in zip(points, bare)), bandwidth, overhead

    # bandwidths from 1 GB/s to 1 TB/s, log-spaced; then finer around the best
    best = min(error_at(1e9 * 10 ** (3 * k / 199)) for k in range(200))
    step = 10 ** (3 / 199)
    best = min(error_at(best[1] * step ** (2 * k / 199 - 1)) for k in range(200))
    return {"hbm_bytes_per_s": best[1], "decode_overhead_s": best[2]}


def fit_decode_linear(shape: dict, points: list[tuple[int, int, float]]) -> dict:
    """The additive model's decode fields: t = A + B*batch + C*(batch*context) by least squares in relative
    error, each coefficient at least 0 (the best fit over every subset of them, the others at 0)."""
    import numpy as np

    rows = np.array([[1.0, b, b * c] for b, c, _ in points])
    times = np.array([t for _, _, t in points])
    weighted = rows / times[:, None]  # relative error: every row over its measured time
    best = None
    for free in ([0, 1, 2], [0, 1], [0, 2], [1, 2], [0], [1], [2]):  # NOTE: exact non-negative least squares
        coef = np.zeros(3)
        coef[free] = np.linalg.lstsq(weighted[:, free], np.ones(len(points)), rcond=None)[0]
        error = float(np.sum((weighted @ coef - 1) ** 2))
        if (coef >= 0).all() and (best is None or error < best[0]):
            best = (error, coef)
    intercept, per_row, per_kv_token = (float(c) for c in best[1])
    bandwidth = shape["kv_bytes_per_token"] / per_kv_token if per_kv_token > 0 else 1e18
    # NOTE: the cost model reads the weights at the KV's rate too; the overhead is what that leaves of the
    # intercept, negative where a core reads its weights faster per byte than it attends over the KV (the
    # step, intercept + rows + context, is what was fitted, and never below the intercept)
    return {"hbm_bytes_per_s": bandwidth, "decode_row_s": per_row,
            "decode_overhead_s": intercept - shape["weight_bytes"] / bandwidth}


def measure(args) -> dict:
    from mooncake.engine import LLMEngine, SamplingParams
    from mooncake.engine.sequence import SeqStatus

    engine = LLMEngine(EngineConfig(model=args.model, num_threads=1, prefill_chunk=args.chunk,
                                    max_num_batched_tokens=args.chunk + max(args.batches),
                                    max_num_seqs=max(args.batches) + 1, enable_prefix_cache=False,
                                    kv_cache_bytes=args.kv_cache_gib << 30))
    vocab = engine.model.config["vocab_size"]

    def prompt(n: int, salt: int) -> list[int]:
        return [(i * 7919 + salt * 104729) % (vocab - 300) + 100 for i in range(n)]

    prefill = []
    for n in args.prefill_lengths:
        engine.generate([prompt(n, 0)], SamplingParams(max_tokens=1))  # warm-up at this length
        times = []
        for r in range(args.repeats):
            started = time.perf_counter()
            engine.generate([prompt(n, r + 1)], SamplingParams(max_tokens=1))
            times.append(time.perf_counter() - started)
        prefill.append((n, statistics.median(times)))
        print(f"  prefill {n:5d} tokens: {prefill[-1][1] * 1e3:8.1f} ms", file=sys.stderr)
    decode, mixed = [], []
    for batch in args.batches:
        for context in args.contexts:
            # NOTE: rows decode while later prompts prefill: room for those steps, the timed ones and the mixed
            params = SamplingParams(max_tokens=args.steps + args.repeats + 8 + batch * context // args.chunk + batch,
                                    ignore_eos=True)
            ids = [engine.add_request(prompt(context, 100 + i), params) for i in range(batch)]
            while any(len(engine.seqs[i].output_token_ids) == 0 for i in ids):  # every prompt prefilled
                engine.step()

            def all_running():  # a row finished or preempted would make the step a smaller batch than its label
                if any(engine.seqs[i].status is not SeqStatus.RUNNING for i in ids):
                    raise RuntimeError(f"decode batch {batch} x {context}: a row finished or was preempted (KV "
                                       f"cache full: --kv-cache-gib) before its steps were timed")
            times = []
            for _ in range(args.steps):
                all_running()
                started = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - started)
            decode.append((batch, context, statistics.median(times)))
            print(f"  decode batch {batch:3d} x {context:5d} context: {decode[-1][2] * 1e3:8.2f} ms/step",
                  file=sys.stderr)
            if context == args.contexts[0]:  # the same rows beside a new prompt's first chunk, in one step
                times = []
                for r in range(args.repeats):
                    joined = engine.add_request(prompt(args.chunk, 200 + r), SamplingParams(max_tokens=1))
                    all_running()
                    started = time.perf_counter()
                    engine.step()
                    times.append(time.perf_counter() - started)
                    engine.abort(joined)
                mixed.append((batch, context, args.chunk, statistics.median(times)))
                print(f"  mixed: those {batch} rows and a {args.chunk}-token chunk: {mixed[-1][3] * 1e3:8.2f} ms",
                      file=sys.stderr)
            for i in ids:
                engine.abort(i)
            while engine.has_unfinished():
                engine.step()
    return {"config": engine.model.config, "prefill": prefill, "decode": decode, "mixed": mixed}


def recorded(path: Path, model: str) -> dict:
    """An earlier profile's points (its JSON), as `measure` gives them, with its model's config."""
    from mooncake.models.resolve import resolve_model

    data = json.loads(path.read_text())
    points = data["points"]
    return {"config": data.get("config") or resolve_model(data.get("model", model)).config,
            "prefill": [(p["tokens"], p["measured_s"]) for p in points if p["kind"] == "prefill"],
            "decode": [(p["batch"], p["context"], p["measured_s"]) for p in points if p["kind"] == "decode"],
            "mixed": [(p["batch"], p["context"], p["chunk"], p["measured_s"]) for p in points if p["kind"] == "mixed"]}


def fit(config: dict, prefill, decode, mixed=(), step_model: str | None = None) -> tuple[dict, list[dict], dict]:
    """The [cost] table fitted to the measured points under `step_model` (None: the one with the smaller
    error over every point, the mixed steps included), the other model's fit under its `other_fits`; every
    point's measured time and its fitted time under each model; and each model's RMS relative error."""
    shape = shape_of(config)
    c1, c2 = fit_prefill(prefill)
    flops = shape["layers"] * shape["b"] * shape["d_model"] ** 2 / c1
    a = c2 * flops / (shape["layers"] * shape["d_model"])
    base = {**shape, "a": a, "gpu_flops": flops, "mfu": 1.0, "decode_efficiency": 1.0}
    tables = {"roofline": {**base, **fit_decode(shape, flops, a, decode), "step_model": "roofline"},
              "additive": {**base, **fit_decode_linear(shape, decode), "step_model": "additive"}}
    models = {name: CostModel(**table) for name, table in tables.items()}
    rows = [{"kind": "prefill", "tokens": n, "measured_s": t,
             "fitted_s": {k: m.prefill_s(n) for k, m in models.items()}} for n, t in prefill]
    rows += [{"kind": "decode", "batch": b, "context": c, "measured_s": t,
              "fitted_s": {k: m.step_s([], b, b * c) for k, m in models.items()}} for b, c, t in decode]
    rows += [{"kind": "mixed", "batch": b, "context": c, "chunk": n, "measured_s": t,
              "fitted_s": {k: m.step_s([(n, 0)], b, b * c) for k, m in models.items()}} for b, c, n, t in mixed]
    errors = {k: (sum((row["fitted_s"][k] / row["measured_s"] - 1) ** 2 for row in rows) / len(rows)) ** 0.5
              for k in models}
    chosen = step_model or min(errors, key=errors.get)
    return {**tables[chosen], "other_fits": {k: t for k, t in tables.items() if k != chosen}}, rows, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--core", type=int, default=0, help="the CPU core to pin to (one torch thread)")
    parser.add_argument("--chunk", type=int, default=512, help="engine.prefill_chunk, as the live cluster runs")
    parser.add_argument("--prefill-lengths", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per point")
    parser.add_argument("--kv-cache-gib", type=int, default=4,
                        help="engine.kv_cache_bytes in GiB: room for the largest batch x context, every row at once")
    parser.add_argument("--repeats", type=int, default=3, help="prefills (and mixed steps) timed per point")
    parser.add_argument("--step-model", choices=["roofline", "additive"],
                        help="the decode fit written (default: the one with the smaller error over every point)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/profile-smollm2.toml"),
                        help="the [cost] table (JSON of every point beside it)")
    parser.add_argument("--refit", type=Path, metavar="JSON",
                        help="fit an earlier profile's points (its JSON) again instead of measuring")
    args = parser.parse_args()
    offline_hub()
    if args.refit:
        measured = recorded(args.refit, args.model)
    else:
        os.sched_setaffinity(0, {args.core})
        measured = measure(args)
    table, rows, errors = fit(measured["config"], measured["prefill"], measured["decode"], measured["mixed"],
                              args.step_model)
    print(f"\n{'point':<32} {'measured ms':>12} {'roofline ms':>12} {'additive ms':>12}")
    for row in rows:
        name = {"prefill": lambda r: f"prefill {r['tokens']}",
                "decode": lambda r: f"decode {r['batch']} x {r['context']}",
                "mixed": lambda r: f"mixed {r['batch']} x {r['context']} + {r['chunk']}"}[row["kind"]](row)
        print(f"{name:<32} {row['measured_s'] * 1e3:12.2f} {row['fitted_s']['roofline'] * 1e3:12.2f} "
              f"{row['fitted_s']['additive'] * 1e3:12.2f}")
    print("RMS relative error: " + ", ".join(f"{k} {v:.3f}" for k, v in errors.items())
          + f"; written: {table['step_model']}")
    print(f"fitted: {table['gpu_flops'] / 1e9:.1f} GFLOP/s, a = {table['a']:.2f}, "
          f"decode {table['decode_overhead_s'] * 1e3:.2f} ms overhead + weights {table['weight_bytes'] / 1e6:.0f} MB "
          f"at {table['hbm_bytes_per_s'] / 1e9:.3g} GB/s + {table.get('decode_row_s', 0.0) * 1e3:.2f} ms per row + "
          f"{table['kv_bytes_per_token'] / table['hbm_bytes_per_s'] * 1e6:.3g} us per context token")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    others = table.pop("other_fits")
    lines = [f"# scripts/profile_engine.py --model {args.model} on core {args.core} of {os.uname().nodename}",
             "[cost]"] + [f"{k} = {v!r}" for k, v in table.items()]
    for name, other in others.items():  # NOTE: not the simulator's: bench_goodput --real compares it
        lines += ["", f"[other_fits.{name}]"] + [f"{k} = {v!r}" for k, v in other.items()]
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"model": args.model, "config": measured["config"],
                                                         "cost": table, "other_fits": others, "errors": errors,
                                                         "points": rows}, indent=2))
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()

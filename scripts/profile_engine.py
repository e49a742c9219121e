#!/usr/bin/env python3
"""Profiles the real engine on one CPU core and fits the cost model (mooncake/cost.py) to what it measured,
so that the simulator can predict a cluster of such cores (`bench_goodput.py --real` tests that prediction).

Measured, pinned to `--core` with one torch thread: a whole prefill of n tokens (in the live cluster's
chunks), and a decode step at batch B over C tokens of context per row. Fitted:
- prefill: t(n) = c1*n + c2*n^2 by least squares through the origin; the cost model's FLOPs per token come
  from the model's shape (b: its dense matmul FLOPs per token and layer over d_model^2), so c1 gives the
  core's achieved FLOP/s and c2 the attention coefficient a;
- decode: t = overhead + max(compute, memory) (the roofline step), compute from the prefill's FLOP/s, memory
  the weights and the KV read at a fitted bandwidth; the overhead and the bandwidth minimise the relative error.
Every point's measured and fitted time is printed and written (a CPU core is no roofline machine: the error
is part of the result). Writes a TOML [cost] table that `sim.cost_file` reads, and JSON beside it."""

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


def measure(args) -> dict:
    from mooncake.engine import LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, num_threads=1, prefill_chunk=args.chunk,
                                    max_num_batched_tokens=max(args.chunk, max(args.batches)),
                                    max_num_seqs=max(args.batches), enable_prefix_cache=False))
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
    decode = []
    for batch in args.batches:
        for context in args.contexts:
            params = SamplingParams(max_tokens=args.steps + 2, ignore_eos=True)
            ids = [engine.add_request(prompt(context, 100 + i), params) for i in range(batch)]
            while any(len(engine.seqs[i].output_token_ids) == 0 for i in ids):  # every prompt prefilled
                engine.step()
            times = []
            for _ in range(args.steps):
                started = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - started)
            for i in ids:
                engine.abort(i)
            while engine.has_unfinished():
                engine.step()
            decode.append((batch, context, statistics.median(times)))
            print(f"  decode batch {batch:3d} x {context:5d} context: {decode[-1][2] * 1e3:8.2f} ms/step",
                  file=sys.stderr)
    return {"config": engine.model.config, "prefill": prefill, "decode": decode}


def fit(config: dict, prefill, decode) -> tuple[dict, list[dict]]:
    """The [cost] table fitted to the measured points, and every point's measured and fitted time."""
    shape = shape_of(config)
    c1, c2 = fit_prefill(prefill)
    flops = shape["layers"] * shape["b"] * shape["d_model"] ** 2 / c1
    a = c2 * flops / (shape["layers"] * shape["d_model"])
    table = {**shape, "a": a, "gpu_flops": flops, "mfu": 1.0, "decode_efficiency": 1.0,
             **fit_decode(shape, flops, a, decode)}
    model = CostModel(**table)
    rows = [{"kind": "prefill", "tokens": n, "measured_s": t, "fitted_s": (s := model.prefill_s(n)), "ratio": s / t}
            for n, t in prefill]
    rows += [{"kind": "decode", "batch": b, "context": c, "measured_s": t,
              "fitted_s": (s := model.step_s([], b, b * c)), "ratio": s / t} for b, c, t in decode]
    return table, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--core", type=int, default=0, help="the CPU core to pin to (one torch thread)")
    parser.add_argument("--chunk", type=int, default=512, help="engine.prefill_chunk, as the live cluster runs")
    parser.add_argument("--prefill-lengths", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per point")
    parser.add_argument("--repeats", type=int, default=3, help="prefills timed per length")
    parser.add_argument("--out", type=Path, default=Path("bench-results/profile-smollm2.toml"),
                        help="the [cost] table (JSON of every point beside it)")
    args = parser.parse_args()
    offline_hub()
    os.sched_setaffinity(0, {args.core})
    measured = measure(args)
    table, rows = fit(measured["config"], measured["prefill"], measured["decode"])
    print(f"\n{'point':<28} {'measured ms':>12} {'fitted ms':>10} {'fitted/measured':>16}")
    for row in rows:
        name = (f"prefill {row['tokens']}" if row["kind"] == "prefill"
                else f"decode {row['batch']} x {row['context']}")
        print(f"{name:<28} {row['measured_s'] * 1e3:12.2f} {row['fitted_s'] * 1e3:10.2f} {row['ratio']:16.2f}")
    print(f"\nfitted: {table['gpu_flops'] / 1e9:.1f} GFLOP/s, a = {table['a']:.2f}, "
          f"{table['hbm_bytes_per_s'] / 1e9:.1f} GB/s, decode overhead {table['decode_overhead_s'] * 1e3:.2f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"# scripts/profile_engine.py --model {args.model} on core {args.core} of {os.uname().nodename}",
             "[cost]"] + [f"{k} = {v!r}" for k, v in table.items()]
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"model": args.model, "cost": table, "points": rows}, indent=2))
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()

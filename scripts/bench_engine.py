#!/usr/bin/env python3
"""Engine benchmark: our engine beside Hugging Face transformers on the same weights, in one run.

Prefill tokens/s at 128 / 512 / 2048 tokens (HF baseline: one forward pass computing only the last
position's logits, as generate does); decode tokens/s at batch 1 / 8 / 32 (HF baseline: generate() for
the same requests one after another, plus HF's own padded batch for reference); prefill FLOP/s against a
plain torch matmul measured in the same run; decode without the fused layer ops (backends/kernels/fused_ops.c)
beside decode with them, where they are built. Prints a table, writes JSON (default bench-results/engine.json).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mooncake.config import EngineConfig  # noqa: E402
from mooncake.engine import LLMEngine, SamplingParams  # noqa: E402
from mooncake.env import offline_hub  # noqa: E402

GOALS = {"decode_b1": 1.0, "decode_b8": 3.0, "prefill": 0.9}


def timed(fn, repeats: int) -> float:
    """Median wall time of `repeats` calls after one warm-up."""
    return paired({"x": fn}, repeats)["x"]


def paired(fns: dict, repeats: int, warmup: bool = True) -> dict:
    """Median wall time of each function, run in turn `repeats` times (after one warm-up each), so that
    the machine's noise falls on ours and the baseline alike."""
    if warmup:
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def matmul_flops(repeats: int) -> float:
    """FLOP/s of a plain float32 matmul shaped like the model's widest layer: the ceiling on this CPU."""
    a, b = torch.randn(2048, 576), torch.randn(576, 1536)
    seconds = timed(lambda: torch.mm(a, b), repeats * 5)
    return 2 * 2048 * 576 * 1536 / seconds


def prefill_flops(cfg, n: int) -> float:
    """Matmul FLOPs of a causal prefill of n tokens (dense layers, attention, one row of lm_head)."""
    h, layers, inter = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or h // heads
    dense = 2 * n * (h * (heads + 2 * kv_heads) * d + heads * d * h + 3 * h * inter)
    attention = 2 * 2 * heads * d * n * (n + 1) / 2  # QK^T and PV over the causal half
    return layers * (dense + attention) + 2 * h * cfg.vocab_size


def prompt_ids(tokenizer, n: int, salt: int = 0) -> list[int]:
    text = " ".join(f"word{(i * 7919 + salt) % 1000}" for i in range(n))
    ids = tokenizer(text)["input_ids"]
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prefill-lengths", default="128,512,2048")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="bench-results/engine.json")
    args = parser.parse_args()
    offline_hub()
    from transformers import AutoModelForCausalLM

    engine = LLMEngine(EngineConfig(model=args.model, prefill_chunk=4096, max_num_batched_tokens=4096,
                                    enable_prefix_cache=False))
    hf = AutoModelForCausalLM.from_pretrained(engine.model.path, dtype=torch.float32).eval()
    tok = engine.tokenizer
    results = {"model": args.model, "threads": torch.get_num_threads(), "torch": torch.__version__,
               "new_tokens": args.new_tokens, "prefill": {}, "decode": {}}

    ceiling = matmul_flops(args.repeats)
    results["matmul_gflops"] = ceiling / 1e9

    for n in map(int, args.prefill_lengths.split(",")):
        ids = prompt_ids(tok, n)
        with torch.inference_mode():
            t = paired({"ours": lambda: engine.generate([ids], SamplingParams(max_tokens=1)),
                        "hf": lambda: hf(torch.tensor([ids]), use_cache=False, logits_to_keep=1)}, args.repeats)
        ours, base = t["ours"], t["hf"]
        flops = prefill_flops(hf.config, n)
        results["prefill"][n] = {"ours_tok_s": n / ours, "hf_tok_s": n / base, "ratio": base / ours,
                                 "ours_gflops": flops / ours / 1e9, "of_matmul_ceiling": flops / ours / ceiling}

    greedy = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)

    def hf_one(ids):
        return hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                           pad_token_id=0)

    def hf_padded(batch):
        tok.padding_side = "left"
        enc = tok.pad({"input_ids": batch}, return_tensors="pt")
        return hf.generate(**enc, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                           do_sample=False, pad_token_id=tok.pad_token_id or 0)

    def unfused(fn):
        fused, engine.runner.fused = engine.runner.fused, None
        try:
            return fn()
        finally:
            engine.runner.fused = fused

    for b in map(int, args.batches.split(",")):
        batch = [prompt_ids(tok, 32, salt=i) for i in range(b)]
        total = b * args.new_tokens
        fns = {"ours": lambda: engine.generate(batch, greedy), "hf_seq": lambda: [hf_one(ids) for ids in batch]}
        if engine.runner.fused is not None:
            fns["ours_unfused"] = lambda: unfused(lambda: engine.generate(batch, greedy))
        if b > 1:
            fns["hf_pad"] = lambda: hf_padded(batch)
        # Short runs are repeated to average out noise; the longest is long enough as it is.
        repeats = args.repeats if b == 1 else 2 if b <= 8 else 1
        with torch.inference_mode():
            t = paired(fns, repeats=repeats, warmup=b == 1)
        ours, sequential, padded = t["ours"], t["hf_seq"], t.get("hf_pad", t["hf_seq"])
        results["decode"][b] = {"ours_tok_s": total / ours, "hf_sequential_tok_s": total / sequential,
                                "hf_padded_batch_tok_s": total / padded, "ratio_vs_sequential": sequential / ours,
                                "ratio_vs_padded_batch": padded / ours}
        if "ours_unfused" in t:
            results["decode"][b]["fused_ops_speedup"] = t["ours_unfused"] / ours
        print(f"  decode batch {b}: ours {total / ours:.1f} tok/s", file=sys.stderr)

    print_table(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")


def print_table(r: dict) -> None:
    print(f"\nmodel {r['model']}, torch {r['torch']}, {r['threads']} threads, "
          f"plain matmul ceiling {r['matmul_gflops']:.1f} GFLOP/s")
    print(f"\n{'prefill':<10}{'ours tok/s':>12}{'HF tok/s':>12}{'ratio':>8}{'goal':>7}{'ours GFLOP/s':>14}{'of ceiling':>12}")
    for n, p in r["prefill"].items():
        print(f"{n:<10}{p['ours_tok_s']:>12.1f}{p['hf_tok_s']:>12.1f}{p['ratio']:>7.2f}x{GOALS['prefill']:>6.1f}x"
              f"{p['ours_gflops']:>14.1f}{p['of_matmul_ceiling']:>11.0%}")
    print(f"\n{'decode':<10}{'ours tok/s':>12}{'HF seq tok/s':>14}{'ratio':>8}{'goal':>7}{'HF batch tok/s':>16}{'ratio':>8}"
          f"{'fused ops':>11}")
    for b, d in r["decode"].items():
        goal = {1: GOALS["decode_b1"], 8: GOALS["decode_b8"]}.get(int(b))
        goal_s = f"{goal:>6.1f}x" if goal else f"{'-':>7}"
        print(f"{'batch ' + str(b):<10}{d['ours_tok_s']:>12.1f}{d['hf_sequential_tok_s']:>14.1f}"
              f"{d['ratio_vs_sequential']:>7.2f}x{goal_s}{d['hf_padded_batch_tok_s']:>16.1f}"
              f"{d['ratio_vs_padded_batch']:>7.2f}x{d.get('fused_ops_speedup', float('nan')):>10.2f}x")


if __name__ == "__main__":
    main()

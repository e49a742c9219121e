#!/usr/bin/env python3
"""What a structured output costs the engine: decode step time with a JSON-schema mask on every row against
the same batch without one, at batch 1 and 32, in one run (rounds alternate, medians of each).

Both batches decode the same number of tokens from the same prompts; the schema (an array of exactly 1,000
small integers) stays open for the whole run, so every step of the constrained batch computes a mask per row.
The first grammar request of an engine builds llguidance's tokenizer (reported apart, as `tokenizer_s`).
Prints a table and writes bench-results/grammar.json."""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import llguidance

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mooncake.config import EngineConfig  # noqa: E402
from mooncake.engine import LLMEngine, SamplingParams  # noqa: E402
from mooncake.models.fetch import fetch_model  # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1000,
          "maxItems": 1000}


def decode_steps(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[float]:
    """Seconds of each step in which every request decodes (their prefills left out)."""
    rids = [engine.add_request(p, params) for p in prompts]
    times = []
    while engine.has_unfinished():
        decoding = all(engine.seqs[r].output_token_ids for r in rids if r in engine.seqs)
        start = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - start)
    for r in rids:
        assert len(engine.pop_completion(r).token_ids) == params.max_tokens  # no row left the batch early
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=48, help="tokens each request decodes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench-results/grammar.json")
    args = ap.parse_args()

    engine = LLMEngine(EngineConfig(model=str(fetch_model(args.model)), num_kv_blocks=2048))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    started = time.perf_counter()
    _ = engine.grammars.tokenizer
    report = {"model": args.model, "tokenizer_s": round(time.perf_counter() - started, 3), "batches": {}}
    plain = SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=1, ignore_eos=True)
    masked = SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=1, ignore_eos=True, grammar=grammar)
    decode_steps(engine, [engine.tokenizer("warm up")["input_ids"]], masked)
    print(f"{'batch':>5} {'plain step ms':>14} {'JSON-mask step ms':>18} {'ratio':>7} {'mask ms/step':>13}")
    for batch in args.batches:
        prompts = [engine.tokenizer(f"List some numbers, take {i}:")["input_ids"] for i in range(batch)]
        times = {"plain": [], "json": []}
        for _ in range(args.rounds):
            times["plain"] += decode_steps(engine, prompts, plain)
            times["json"] += decode_steps(engine, prompts, masked)
        base, constrained = statistics.median(times["plain"]), statistics.median(times["json"])
        report["batches"][batch] = {"plain_step_ms": round(base * 1e3, 3), "json_step_ms": round(constrained * 1e3, 3),
                                    "ratio": round(constrained / base, 3),
                                    "mask_ms_per_step": round((constrained - base) * 1e3, 3),
                                    "steps": {k: len(v) for k, v in times.items()}}
        print(f"{batch:>5} {base * 1e3:>14.2f} {constrained * 1e3:>18.2f} {constrained / base:>7.3f} "
              f"{(constrained - base) * 1e3:>13.2f}")
    print(f"llguidance tokenizer built in {report['tokenizer_s']} s (once per engine, at its first grammar)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

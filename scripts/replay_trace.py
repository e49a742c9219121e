#!/usr/bin/env python3
"""Replay a slice of a Mooncake trace against a live `mooncake dev` cluster, once per placement policy,
and compare what clients saw: TTFT, TBT, prefix-cache hits and wall time.

Each trace block id becomes a fixed pseudo-random run of `--block-tokens` tokens (the same id, the same
tokens), so requests that share hash ids share real prompt prefixes and real KV blocks (DESIGN section
9). Arrivals keep the trace's timing, compressed by `--speed`; prompts are capped at `--max-input`
tokens and outputs at `--max-output`. A fixed number of requests, a bounded number in flight: every run
ends by itself. Prints a table and writes bench-results/replay.json."""

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mooncake.config import load_config  # noqa: E402
from mooncake.dev import DevCluster  # noqa: E402
from mooncake.sim.trace import block_tokens, load_trace, trace_prompt  # noqa: E402


def prompt_of(request, args) -> list[int]:
    return trace_prompt(request.hash_ids, args.block_tokens, args.max_input)


def one(url: str, model: str, prompt: list[int], max_tokens: int, timeout_s: float) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    times, usage = [], None
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for line in r:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                elif event.get("choices"):
                    times.append(time.perf_counter())
    except urllib.error.HTTPError as exc:
        return {"status": exc.code}
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"status": 200, "ttft_s": times[0] - start if times else None, "tbt_s": statistics.mean(gaps) if gaps else None,
            "prompt": usage["prompt_tokens"] if usage else len(prompt),
            "cached": usage["prompt_tokens_details"]["cached_tokens"] if usage else 0}


def replay(args, trace, placement: str) -> dict:
    cfg = load_config(None, {"engine.model": args.model, "engine.block_size": args.block_tokens, "api.port": 0,
                             "engine.kv_cache_bytes": args.kv_bytes, "store.dram_bytes": 4 * args.kv_bytes,
                             "engine.num_threads": 1, "instance.transport": args.transport,
                             "conductor.placement": placement, "conductor.admission": "accept-all"})
    model = cfg.engine.model
    with DevCluster(cfg, args.prefill, args.decode, 1, Path(tempfile.mkdtemp(prefix="replay-")),
                    log_to_files=True) as cluster:
        one(cluster.url, model, block_tokens(-2, 32), 2, 60)  # warm up every path once
        results = [None] * len(trace)
        limit = threading.Semaphore(args.max_in_flight)
        t0 = trace[0].timestamp_ms
        start = time.perf_counter()

        def run(i, request):
            try:
                results[i] = one(cluster.url, model, prompt_of(request, args),
                                 max(1, min(request.output_length, args.max_output)), args.timeout)
            finally:
                limit.release()

        with ThreadPoolExecutor(args.max_in_flight) as pool:
            for i, request in enumerate(trace):
                delay = (request.timestamp_ms - t0) / 1000 / args.speed - (time.perf_counter() - start)
                if delay > 0:
                    time.sleep(delay)
                limit.acquire()
                pool.submit(run, i, request)
        wall = time.perf_counter() - start
    ok = [r for r in results if r and r["status"] == 200 and r["ttft_s"] is not None]
    ttfts = sorted(r["ttft_s"] for r in ok)
    tbts = [r["tbt_s"] for r in ok if r["tbt_s"] is not None]
    return {"placement": placement, "requests": len(trace), "ok": len(ok), "wall_s": wall,
            "ttft_mean_s": statistics.mean(ttfts), "ttft_p50_s": ttfts[len(ttfts) // 2],
            "ttft_p90_s": ttfts[int(len(ttfts) * 0.9)], "tbt_mean_s": statistics.mean(tbts) if tbts else 0.0,
            "cached_share": sum(r["cached"] for r in ok) / max(1, sum(r["prompt"] for r in ok))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=ROOT.parent / "shared/traces/conversation_trace.jsonl")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--speed", type=float, default=3.0, help="trace seconds per wall second")
    parser.add_argument("--policies", default="kvcache-centric,local-cache-aware,round-robin")
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--transport", default="tcp")
    parser.add_argument("--block-tokens", type=int, default=16, help="tokens per trace block (= engine.block_size)")
    parser.add_argument("--max-input", type=int, default=1024)
    parser.add_argument("--max-output", type=int, default=16)
    parser.add_argument("--max-in-flight", type=int, default=16)
    parser.add_argument("--kv-bytes", type=int, default=64 << 20, help="paged KV per instance")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=Path("bench-results/replay.json"))
    args = parser.parse_args()

    trace = load_trace(args.trace)[:args.requests]
    rows = [replay(args, trace, p) for p in args.policies.split(",")]
    base = rows[-1]
    print(f"{len(trace)} requests of {args.trace.name} at {args.speed:g}x, {args.prefill}P{args.decode}D "
          f"{args.model} over {args.transport}; blocks of {args.block_tokens} tokens, prompts <= {args.max_input}")
    print(f"{'placement':>18}{'ok':>6}{'TTFT mean':>11}{'p50':>8}{'p90':>8}{'TBT mean':>10}{'cached':>8}"
          f"{'wall':>8}{'TTFT vs ' + base['placement']:>26}")
    for r in rows:
        print(f"{r['placement']:>18}{r['ok']:>6}{r['ttft_mean_s']:>10.3f}s{r['ttft_p50_s']:>7.3f}s"
              f"{r['ttft_p90_s']:>7.3f}s{r['tbt_mean_s'] * 1000:>8.1f}ms{r['cached_share']:>8.1%}{r['wall_s']:>7.1f}s"
              f"{r['ttft_mean_s'] / base['ttft_mean_s']:>25.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

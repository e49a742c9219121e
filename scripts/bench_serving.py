#!/usr/bin/env python3
"""End-to-end serving benchmark: a `mooncake dev` cluster (every role its own process) through the REST
API, per transport, each figure beside its baseline from the same run:

- TTFT of a cold long prompt with chunk-wise KV streaming on vs off (the KV of earlier chunks moves
  while later chunks compute, so TTFT should grow less than compute + transfer);
- TTFT of a prompt whose long prefix is cached vs the same length cold (prefix reuse);
- throughput of concurrent requests through the cluster vs one in-process LLMEngine on the same prompts.

Every loop runs a fixed number of requests. Prints a table and writes bench-results/serving.json."""

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mooncake.config import load_config  # noqa: E402
from mooncake.dev import DevCluster  # noqa: E402


def stream_ttft(url: str, model: str, prompt: list[int], max_tokens: int = 4) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    ttft = None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {") and ttft is None:
                ttft = time.perf_counter() - start
    return ttft


def complete(url: str, model: str, prompt: list[int], max_tokens: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["usage"]["completion_tokens"]


def tokens(n: int, salt: str) -> list[int]:
    """n token ids, different for every salt (ids from the byte range every tokenizer here has)."""
    seed = uuid.uuid5(uuid.NAMESPACE_OID, salt).int
    return [32 + (seed >> (i % 100)) % 90 + (i % 7) for i in range(n)]


def cluster_for(args, transport: str, stream_kv: bool) -> DevCluster:
    cfg = load_config(None, {"engine.model": args.model, "api.port": 0, "instance.transport": transport,
                             "instance.stream_kv": stream_kv, "engine.prefill_chunk": args.chunk,
                             "engine.kv_cache_bytes": 1 << 30, "store.dram_bytes": 1 << 30,
                             "conductor.admission": "accept-all"})
    return DevCluster(cfg, workdir=Path(tempfile.mkdtemp(prefix="bench-serving-")), log_to_files=True)


def run_transport(args, transport: str) -> dict:
    model = args.model
    out = {}
    ttft = {}
    for stream_kv in (True, False):
        with cluster_for(args, transport, stream_kv) as cluster:
            stream_ttft(cluster.url, model, tokens(64, "warm-up"))
            ttft[stream_kv] = [stream_ttft(cluster.url, model, tokens(args.prompt_tokens, f"{transport}{stream_kv}{i}"))
                               for i in range(args.repeats)]
            if not stream_kv:
                continue
            prefix = tokens(args.prompt_tokens - 16, f"{transport}-prefix")
            stream_ttft(cluster.url, model, prefix + tokens(16, "first"))
            time.sleep(1.0)  # heartbeats carry the new blocks into the conductor's index
            warm = [stream_ttft(cluster.url, model, prefix + tokens(16, f"next{i}")) for i in range(args.repeats)]
            out["ttft_prefix_hit_s"] = statistics.median(warm)
            prompts = [tokens(args.batch_prompt_tokens, f"{transport}-batch{i}") for i in range(args.concurrency)]
            start = time.perf_counter()
            counts = [0] * len(prompts)

            def one(i):
                counts[i] = complete(cluster.url, model, prompts[i], args.batch_max_tokens)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            out["cluster_tokens_per_s"] = sum(counts) / (time.perf_counter() - start)
    out["ttft_stream_s"] = statistics.median(ttft[True])
    out["ttft_no_stream_s"] = statistics.median(ttft[False])
    out["ttft_cold_s"] = out["ttft_stream_s"]
    return out


def engine_baseline(args) -> float:
    """Tokens/s of one in-process engine over the same concurrent prompts: no processes, no network."""
    from mooncake.config import EngineConfig
    from mooncake.engine import LLMEngine, SamplingParams
    engine = LLMEngine(EngineConfig(model=args.model, prefill_chunk=args.chunk, kv_cache_bytes=1 << 30))
    prompts = [tokens(args.batch_prompt_tokens, f"engine-batch{i}") for i in range(args.concurrency)]
    start = time.perf_counter()
    done = engine.generate(prompts, SamplingParams(max_tokens=args.batch_max_tokens, ignore_eos=True))
    return sum(len(d.token_ids) for d in done) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--transports", default="tcp,shm")
    parser.add_argument("--prompt-tokens", type=int, default=1536)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--batch-prompt-tokens", type=int, default=128)
    parser.add_argument("--batch-max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench-results/serving.json"))
    args = parser.parse_args()

    results = {"args": {k: str(v) for k, v in vars(args).items()}, "engine_tokens_per_s": engine_baseline(args)}
    for transport in args.transports.split(","):
        results[transport] = run_transport(args, transport)
    print(f"model {args.model}, prompt {args.prompt_tokens} tokens in chunks of {args.chunk}; "
          f"{args.concurrency} concurrent requests of {args.batch_prompt_tokens} + {args.batch_max_tokens} tokens")
    print(f"{'transport':>10}{'TTFT stream':>13}{'TTFT at end':>13}{'ratio':>7}{'TTFT hit':>10}{'hit/cold':>10}"
          f"{'cluster tok/s':>15}{'engine tok/s':>14}{'ratio':>7}")
    for transport in args.transports.split(","):
        r = results[transport]
        print(f"{transport:>10}{r['ttft_stream_s']:>12.3f}s{r['ttft_no_stream_s']:>12.3f}s"
              f"{r['ttft_stream_s'] / r['ttft_no_stream_s']:>7.2f}{r['ttft_prefix_hit_s']:>9.3f}s"
              f"{r['ttft_prefix_hit_s'] / r['ttft_cold_s']:>10.2f}{r['cluster_tokens_per_s']:>15.1f}"
              f"{results['engine_tokens_per_s']:>14.1f}{r['cluster_tokens_per_s'] / results['engine_tokens_per_s']:>7.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

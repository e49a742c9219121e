#!/usr/bin/env python3
"""Scheduler benchmark: placement (+ admission) decisions per second and latency percentiles for the
KVCache-centric policy with 64 prefill and 64 decode instances and a 1M-block prefix index, beside the
random policy (the cheapest possible decision) in the same run. Also what else the conductor does per
request: building the cluster view over the requests in flight, and an estimator update (beside a full
least-squares refit over the window, what each update cost before). Prints a table, writes JSON."""

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mooncake.conductor.admission import make_admission_policy  # noqa: E402
from mooncake.conductor.estimators import BandwidthEstimator, DecodeStepModel, PrefillTimeModel  # noqa: E402
from mooncake.conductor.policies import Estimators, make_placement_policy  # noqa: E402
from mooncake.conductor.prefix_index import PrefixIndex  # noqa: E402
from mooncake.conductor.view import ClusterView, DecodeLoad, DecodeView, PrefillView, RequestView  # noqa: E402

BLOCK_SIZE = 512
BLOCK_BYTES = 512 * 320 * 1024  # LLaMA3-70B: 320 KiB of KV per token


def build(num_prefill: int, num_decode: int, num_blocks: int, seed: int):
    """A cluster whose index holds `num_blocks` blocks: conversations of 1-60 blocks sharing a few system
    prompts, each on one to three holders (prefill instances and 8 cache nodes)."""
    rng = random.Random(seed)
    index = PrefixIndex()
    holders = [f"p{i}" for i in range(num_prefill)] + [f"cache{i}" for i in range(8)]
    conversations, next_hash, blocks = [], 1, 0
    system_prompts = [[next_hash + i] for i in range(16)]
    next_hash += 16
    while blocks < num_blocks:
        length = rng.randint(1, 60)
        chain = rng.choice(system_prompts) + list(range(next_hash, next_hash + length))
        next_hash += length
        blocks += length
        conversations.append(chain)
        for holder in rng.sample(holders, rng.randint(1, 3)):
            index.add(holder, chain)
    prefills = [PrefillView(f"p{i}", queued_prefill_s=rng.uniform(0, 5)) for i in range(num_prefill)]
    decodes = [DecodeView(f"d{i}", [DecodeLoad(0.0, rng.uniform(1, 60), rng.randint(1000, 30000))
                                    for _ in range(rng.randint(0, 32))]) for i in range(num_decode)]
    cluster = ClusterView(prefills, decodes, block_size=BLOCK_SIZE, block_bytes=BLOCK_BYTES)
    return index, cluster, conversations


def requests(conversations, count: int, seed: int):
    rng = random.Random(seed)
    out = []
    for i in range(count):
        chain = rng.choice(conversations)
        hashes = tuple(chain[:rng.randint(1, len(chain))]) + tuple(range(10**12 + i * 100, 10**12 + i * 100 +
                                                                         rng.randint(0, 8)))
        out.append(RequestView(f"r{i}", num_tokens=len(hashes) * BLOCK_SIZE, block_hashes=hashes, max_tokens=400))
    return out


def run(policy_name: str, index, cluster, reqs) -> dict:
    est = Estimators(PrefillTimeModel(0.05, 1.5e-4, 1e-9), DecodeStepModel(0.02, 5e-4, 1e-7),
                     BandwidthEstimator(100e9 / 8))
    policy = make_placement_policy(policy_name, index, est)
    admission = make_admission_policy("predictive", est.decode_step, ttft_slo_s=30.0, tbt_slo_s=0.1)
    latencies = []
    t_start = time.perf_counter()
    for r in reqs:
        t0 = time.perf_counter()
        placement = policy.place(r, cluster, now=0.0)
        admission.admit(r, placement, cluster, now=0.0)
        latencies.append(time.perf_counter() - t0)
    total = time.perf_counter() - t_start
    latencies.sort()
    return {"decisions_per_s": len(reqs) / total, "p50_ms": statistics.median(latencies) * 1e3,
            "p99_ms": latencies[int(len(latencies) * 0.99)] * 1e3}


def estimator_update_us(samples: int = 5000, window: int = 512) -> dict:
    """Microseconds per prefill-model update: ours (running sums) and a full refit over the window."""
    import numpy as np
    rng = random.Random(2)
    data = [(n := rng.randint(100, 60000), r := rng.randint(0, n), 0.02 + 2e-4 * (n - r) + 1e-8 * (n * n - r * r))
            for _ in range(samples)]
    model = PrefillTimeModel(0.02, 2e-3, 1e-7, window=window)
    start = time.perf_counter()
    for n, r, y in data:
        model.observe(n, r, y)
    ours = (time.perf_counter() - start) / samples * 1e6
    rows: list = []
    start = time.perf_counter()
    for n, r, y in data:
        rows = (rows + [([1.0, n - r, n * n - r * r], y)])[-window:]
        np.linalg.lstsq(np.array([f for f, _ in rows]), np.array([t for _, t in rows]), rcond=None)
    full = (time.perf_counter() - start) / samples * 1e6
    return {"running_sums_us": ours, "full_refit_us": full}


def cluster_view_ms(num_prefill: int, num_decode: int, per_instance: int = 16, repeat: int = 200) -> float:
    """Milliseconds to build the live conductor's view with `per_instance` requests on every instance."""
    from mooncake import messages as m
    from mooncake.conductor.decide import cluster_view
    from mooncake.conductor.flight import Flight
    from mooncake.conductor.instances import InstanceRegistry
    from mooncake.sampling import SamplingParams
    registry, flights = InstanceRegistry(1e9), {}
    for role, count in (("prefill", num_prefill), ("decode", num_decode)):
        for i in range(count):
            registry.register(m.Register(instance_id=f"{role}-{i}", role=role, model_id="x", block_size=64,
                                         kv_dtype="bfloat16"), 0.0)
    rng = random.Random(2)
    for i in range(num_prefill * per_instance):
        wire = f"r{i}"
        # NOTE: prompts of the trace's lengths (1k-16k tokens), half of them decoding: the view reads
        # each request's context, so its cost must not grow with it.
        prompt = [1] * rng.randint(1024, 16384)
        flight = Flight(wire, prompt, SamplingParams(max_tokens=512), "api-0", predicted_prefill_s=1.0,
                        in_prefill=i % 2 == 0, decode_start_s=10.0, placed_s=0.0)
        if not flight.in_prefill:
            flight.num_decoded = rng.randint(1, 500)
        flights[wire] = flight
        registry.get(f"prefill-{i % num_prefill}").request_ids.add(wire)
        registry.get(f"decode-{i % num_decode}").request_ids.add(wire)
    start = time.perf_counter()
    for _ in range(repeat):
        cluster_view(registry, flights, 64, 1 << 20, frozenset(), now=5.0)
    return (time.perf_counter() - start) / repeat * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=64)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--out", default="bench-results/scheduler.json")
    args = parser.parse_args()
    t0 = time.perf_counter()
    index, cluster, conversations = build(args.prefill, args.decode, args.blocks, seed=0)
    print(f"index: {len(index):,} blocks, {args.prefill} prefill + {args.decode} decode instances "
          f"(built in {time.perf_counter() - t0:.1f} s)")
    reqs = requests(conversations, args.requests, seed=1)
    results = {name: run(name, index, cluster, reqs) for name in ("random", "kvcache-centric")}
    print(f"\n{'policy':<18}{'decisions/s':>14}{'p50 ms':>10}{'p99 ms':>10}")
    for name, r in results.items():
        print(f"{name:<18}{r['decisions_per_s']:>14,.0f}{r['p50_ms']:>10.3f}{r['p99_ms']:>10.3f}")
    ours, base = results["kvcache-centric"], results["random"]
    print(f"\nkvcache-centric: {ours['decisions_per_s'] / base['decisions_per_s']:.2f}x the random policy's rate; "
          f"goal >= 5,000 decisions/s and p99 <= 1 ms")
    updates = estimator_update_us()
    view_ms = cluster_view_ms(args.prefill, args.decode)
    print(f"estimator update: {updates['running_sums_us']:.1f} us (a full refit over the window: "
          f"{updates['full_refit_us']:.1f} us, {updates['full_refit_us'] / updates['running_sums_us']:.1f}x); "
          f"cluster view over {args.prefill * 16} requests in flight: {view_ms:.3f} ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results, "estimator_update": updates,
                               "cluster_view_ms": view_ms}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

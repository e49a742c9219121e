#!/usr/bin/env python3
"""Hit ratio of one KVCache pool over a trace, per capacity and eviction policy (the store's own
policy classes; hash ids only, no payloads). Prints a table and writes JSON."""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mooncake.errors import MooncakeError  # noqa: E402
from mooncake.sim.trace import load_trace  # noqa: E402
from mooncake.registry import known  # noqa: E402
from mooncake.store.hit_ratio import hit_ratio  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(Path(__file__).resolve().parents[2] / "shared" / "traces" /
                                               "conversation_trace.jsonl"))
    parser.add_argument("--capacity", default="5000,20000,50000,100000", help="pool sizes in blocks")
    parser.add_argument("--policy", default="lru,lfu,length-aware", help=f"any of {', '.join(known('eviction'))}")
    parser.add_argument("--out", default="bench-results/cache_hit.json")
    args = parser.parse_args()
    try:
        requests = [r.hash_ids for r in load_trace(args.trace)]
        capacities = [int(c) for c in args.capacity.split(",")]
        policies = args.policy.split(",")
        unknown = [p for p in policies if p not in known('eviction')]
        if unknown:
            raise MooncakeError(f"unknown policy {', '.join(unknown)} (known: {', '.join(known('eviction'))})")
    except (MooncakeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    refs = sum(len(r) for r in requests)
    distinct = len({k for r in requests for k in r})
    print(f"{args.trace}: {len(requests)} requests, {refs} block references, {distinct} distinct; "
          f"ceiling (infinite cache) {1 - distinct / refs:.1%}")
    results = {}
    print(f"\n{'capacity':>10}" + "".join(f"{p:>14}" for p in policies))
    for capacity in capacities:
        row = {}
        for policy in policies:
            t0 = time.perf_counter()
            row[policy] = hit_ratio(requests, capacity, policy)
            row[f"{policy}_s"] = time.perf_counter() - t0
        results[capacity] = row
        print(f"{capacity:>10}" + "".join(f"{row[p]:>14.1%}" for p in policies))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"trace": args.trace, "requests": len(requests), "results": results}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

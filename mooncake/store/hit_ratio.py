"""Block hit ratio of one cache pool over a trace's hash ids, with the store's eviction policies.

Prefix semantics: a request hits its leading run of cached blocks (a block after a miss is useless
without its prefix), then every block of the request is touched or inserted, in order."""

from collections.abc import Iterable

from mooncake.store.eviction import make_policy


def hit_ratio(requests: Iterable[tuple[int, ...]], capacity_blocks: int, policy_name: str = "lru") -> float:
    policy = make_policy(policy_name)
    cached: set = set()
    hits = total = 0
    for hash_ids in requests:
        total += len(hash_ids)
        for key in hash_ids:
            if key not in cached:
                break
            hits += 1
        for position, key in enumerate(hash_ids):
            if key not in cached:
                if len(cached) >= capacity_blocks:
                    evicted = policy.victim()
                    policy.remove(evicted)
                    cached.discard(evicted)
                cached.add(key)
            policy.touch(key, position)
    return hits / total if total else 0.0

"""One node's share of a simulated KVCache pool: block ids only, evicted by the store's own policy."""

from mooncake.store.eviction import make_policy


class NodePool:
    def __init__(self, capacity_blocks: int, policy: str = "lru"):
        self.capacity = capacity_blocks
        self.policy = make_policy(policy)
        self.blocks: set[int] = set()

    def prefix_len(self, hashes) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def insert(self, hashes) -> tuple[list[int], list[int]]:
        """Touch or insert every block in order; returns (added, evicted) block ids."""
        added, evicted = [], []
        if self.capacity <= 0:
            return added, evicted
        for position, h in enumerate(hashes):
            if h not in self.blocks:
                if len(self.blocks) >= self.capacity:
                    victim = self.policy.victim()
                    self.policy.remove(victim)
                    self.blocks.discard(victim)
                    evicted.append(victim)
                self.blocks.add(h)
                added.append(h)
            self.policy.touch(h, position)
        return added, evicted

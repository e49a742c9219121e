"""The paged KV cache's block accounting: ref counts, a free list, and the hash -> block map that gives
local prefix reuse. Owns no tensors; the scheduler calls it, the KV cache holds the bytes.

A freed block keeps its hash and stays findable until it is handed out again; the free list is ordered
so the least recently freed blocks are reused first (LRU eviction of cached prefixes)."""

from collections import OrderedDict, deque


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # ("add" | "evict", hash) as hashes enter and leave the prefix cache, for a prefill instance to
        # report to the conductor's index. A deque: drained from another thread than the one appending.
        self.events: deque[tuple[str, int]] = deque(maxlen=1 << 16)

    @property
    def num_used(self) -> int:
        """Blocks some sequence holds (cached-but-free blocks do not count)."""
        return self.num_blocks - len(self.free)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks with ref count 1, or None when fewer than n are free (nothing changes)."""
        if n > len(self.free):
            return None
        blocks = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            old = self.block_hash[block]
            if old is not None:  # evict the cached prefix this block held
                del self.hash_to_block[old]
                self.block_hash[block] = None
                self.events.append(("evict", old))
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def match_prefix(self, hashes: list[int]) -> list[int]:
        """Blocks holding the longest cached run of leading `hashes` (ref counts unchanged)."""
        blocks = []
        for h in hashes:
            block = self.hash_to_block.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def acquire(self, blocks: list[int]) -> None:
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        # NOTE: tail blocks go on the free list first, so a prefix's first blocks are evicted last.
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None

    def register(self, block: int, block_hash: int) -> bool:
        """Make a full, computed block findable by its hash; False if another block already holds it."""
        if block_hash in self.hash_to_block:
            return self.hash_to_block[block_hash] == block
        self.hash_to_block[block_hash] = block
        self.block_hash[block] = block_hash
        self.events.append(("add", block_hash))
        return True

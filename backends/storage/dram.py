"""DRAM tier: one preallocated arena; blocks live at offsets found by a first-fit free list that
coalesces neighbours on free. `get` returns a zero-copy view, valid until the block is removed (the
store's leases keep a block in place while a reader holds it)."""

import bisect

from mooncake.store.tier import StorageTier


class DramTier(StorageTier):
    name = "dram"

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._arena = bytearray(capacity_bytes)
        self._view = memoryview(self._arena)
        self._free: list[tuple[int, int]] = [(0, capacity_bytes)] if capacity_bytes else []  # (offset, size)
        self._blocks: dict[int, tuple[int, int]] = {}  # key -> (offset, size)
        self._used = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    def put(self, key, data) -> bool:
        size = len(memoryview(data).cast("B"))
        if key in self._blocks:
            return True
        for i, (offset, free_size) in enumerate(self._free):
            if free_size >= size:
                if free_size == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free_size - size)
                self._view[offset:offset + size] = memoryview(data).cast("B")
                self._blocks[key] = (offset, size)
                self._used += size
                return True
        return False

    def get(self, key):
        loc = self._blocks.get(key)
        return None if loc is None else self._view[loc[0]:loc[0] + loc[1]]

    def remove(self, key) -> bool:
        loc = self._blocks.pop(key, None)
        if loc is None:
            return False
        self._used -= loc[1]
        self._release(*loc)
        return True

    def _release(self, offset: int, size: int) -> None:
        i = bisect.bisect_left(self._free, (offset, 0))
        if i < len(self._free) and offset + size == self._free[i][0]:  # merge with the next extent
            size += self._free[i][1]
            del self._free[i]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # and with the previous
            offset, size = self._free[i - 1][0], self._free[i - 1][1] + size
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (offset, size))

    def size_of(self, key):
        loc = self._blocks.get(key)
        return None if loc is None else loc[1]

    def keys(self):
        return iter(list(self._blocks))

    def largest_free_extent(self) -> int:
        return max((size for _, size in self._free), default=0)

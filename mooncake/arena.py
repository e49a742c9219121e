"""A first-fit allocator of byte ranges in a fixed region, coalescing neighbours on free. Owns no memory:
the DRAM tier and the mooncake transport's staging buffer place bytes at the offsets it hands out."""

import bisect


class Arena:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._free: list[tuple[int, int]] = [(0, capacity_bytes)] if capacity_bytes else []  # (offset, size)

    def alloc(self, size: int) -> int | None:
        """Offset of a free range of `size` bytes, or None if no single range is that large."""
        for i, (offset, free_size) in enumerate(self._free):
            if free_size >= size:
                if free_size == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free_size - size)
                return offset
        return None

    def free(self, offset: int, size: int) -> None:
        i = bisect.bisect_left(self._free, (offset, 0))
        if i < len(self._free) and offset + size == self._free[i][0]:  # merge with the next range
            size += self._free[i][1]
            del self._free[i]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # and with the previous
            offset, size = self._free[i - 1][0], self._free[i - 1][1] + size
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (offset, size))

    def largest_free_extent(self) -> int:
        return max((size for _, size in self._free), default=0)

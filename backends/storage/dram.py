"""DRAM tier: one preallocated arena; blocks live at offsets handed out by `mooncake.arena.Arena`.
`get` returns a zero-copy view, valid until the block is removed (the store's leases keep a block in
place while a reader holds it).

With `shared=True` the arena is a file in /dev/shm, so a reader on the same host can map it and copy a
block straight out of the store (the shm transport's one-copy read): `location(key)` says where."""

import mmap
import os
import uuid

from mooncake.arena import Arena
from mooncake.store.tier import StorageTier


def _prefault(view: memoryview, chunk: int = 64 << 20) -> None:
    """Touch every page now. A shared-memory file is filled page by page on first write, which runs at a
    tenth of memcpy speed; paying that at start keeps it off every put (a bytearray arena is already
    touched by its zero fill)."""
    zeros = bytes(min(chunk, len(view)))
    for offset in range(0, len(view), chunk):
        n = min(chunk, len(view) - offset)
        view[offset:offset + n] = zeros[:n]


class DramTier(StorageTier):
    name = "dram"

    def __init__(self, capacity_bytes: int, shared: bool = False):
        self.capacity_bytes = capacity_bytes
        self._arena = Arena(capacity_bytes)
        self.path: str | None = None
        self._mapping = None
        if shared:
            # NOTE: named like the shm transport's segments, so its stale-segment sweep and its path
            # checks cover this file too.
            from backends.transports.shm import PREFIX, SHM_DIR, open_private, remove_stale_segments
            remove_stale_segments()
            self.path = str(SHM_DIR / f"{PREFIX}{os.getpid()}-dram-{uuid.uuid4().hex[:12]}")
            with open_private(self.path) as f:
                f.truncate(capacity_bytes)
                self._mapping = mmap.mmap(f.fileno(), capacity_bytes)
            self._view = memoryview(self._mapping)
            _prefault(self._view)
        else:
            self._view = memoryview(bytearray(capacity_bytes))
        self._blocks: dict[int, tuple[int, int]] = {}  # key -> (offset, size)
        self._used = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    def put(self, key, data) -> bool:
        if key in self._blocks:
            return True
        view = memoryview(data).cast("B")
        offset = self._arena.alloc(len(view))
        if offset is None:
            return False
        self._view[offset:offset + len(view)] = view
        self._blocks[key] = (offset, len(view))
        self._used += len(view)
        return True

    # Ranges written in place (mooncake/transfer/windows.py): reserved, filled by a writer, then adopted.

    def reserve(self, size: int) -> int | None:
        """Offset of `size` free bytes set aside (no block yet), or None if no range is that large."""
        offset = self._arena.alloc(size)
        if offset is not None:
            self._used += size
        return offset

    def view_of(self, offset: int, size: int) -> memoryview:
        return self._view[offset:offset + size]

    def adopt(self, key: int, offset: int, size: int) -> None:
        """Make a reserved range, already written, block `key`."""
        self._blocks[key] = (offset, size)

    def release(self, offset: int, size: int) -> None:
        """Give back a reserved range that did not become a block."""
        self._arena.free(offset, size)
        self._used -= size

    def get(self, key):
        loc = self._blocks.get(key)
        return None if loc is None else self._view[loc[0]:loc[0] + loc[1]]

    def remove(self, key) -> bool:
        loc = self._blocks.pop(key, None)
        if loc is None:
            return False
        self._used -= loc[1]
        self._arena.free(*loc)
        return True

    def size_of(self, key):
        loc = self._blocks.get(key)
        return None if loc is None else loc[1]

    def keys(self):
        return iter(list(self._blocks))

    def largest_free_extent(self) -> int:
        return self._arena.largest_free_extent()

    def location(self, key) -> tuple[str, int, int] | None:
        """(file, offset, size) of a block in a shared arena; None if absent or not shared."""
        loc = self._blocks.get(key)
        return None if loc is None or self.path is None else (self.path, loc[0], loc[1])

    def close(self) -> None:
        if self._mapping is not None:
            try:
                self._view.release()
                self._mapping.close()
            except BufferError:  # a reader's view is still alive; the mapping goes with it
                pass
            os.unlink(self.path)
            self._mapping = None

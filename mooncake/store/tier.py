"""The storage-tier contract: a place that holds immutable blocks by 64-bit key up to a byte capacity.

Caller: `mooncake.store.store.KVStore`, which owns eviction, leases and moving blocks between tiers; a
tier only stores, finds and deletes. Backends: `backends/storage/dram.py` (preallocated arena) and
`backends/storage/ssd.py` (a directory, crash-safe)."""

from abc import ABC, abstractmethod
from collections.abc import Iterator


class StorageTier(ABC):
    name: str
    capacity_bytes: int

    path: str | None = None
    """The shared-memory file that holds the tier's bytes, when it is one: same-host peers then read
    blocks where they lie (`location`) and write new ones in place (`reserve`, `view_of`, `adopt`; the
    DRAM tier in shared mode). None: the tier offers neither."""

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @abstractmethod
    def put(self, key: int, data) -> bool:
        """Store `data` (any bytes-like object) under a new key; False when it does not fit now."""

    @abstractmethod
    def get(self, key: int) -> memoryview | bytes | None:
        """The block's bytes, or None if absent. A tier that finds its copy corrupt drops it and
        returns None: corrupt data is never returned."""

    @abstractmethod
    def remove(self, key: int) -> bool: ...

    @abstractmethod
    def size_of(self, key: int) -> int | None: ...

    @abstractmethod
    def keys(self) -> Iterator[int]: ...

    def __contains__(self, key: int) -> bool:
        return self.size_of(key) is not None

    def location(self, key: int) -> tuple[str, int, int] | None:
        """With a `path`: (that file, offset, size) of a held block, else None."""
        return None

    def close(self) -> None:
        """Release resources (files, memory); the default has none."""

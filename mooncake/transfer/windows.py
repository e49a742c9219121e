"""Write windows: ranges of a lender's shared memory lent to a same-host writer (the shm transport), who
puts blocks by writing them there in place. The lender then checks each block's checksum where it lies
and adopts the range as the block's storage, so a put costs the lender one read instead of a read and a
copy, and the writer one copy instead of two.

Lenders: a cache node's shared DRAM tier (the store: blocks become cache entries), and an shm endpoint's
own segment, for a service that keeps what it is given (the decode inbox: blocks stay where they were
written until the service lets go of them).

A window belongs to one writer. Blocks are committed at non-overlapping ranges inside it; a range whose
block fails its checksum, or that the lender does not take, goes back at once; what no block took goes
back when the window closes, or expires after `ttl_s` without a commit (its writer may have died); a
writer must stop writing into a window before then (the shm transport stops at TTL minus a margin after
its last commit was sent), since the bytes may be lent or stored anew. Blocks are never read from a
range before their commit verified it, and a reader verifies every block anyway."""

import bisect
import itertools
import time
from dataclasses import dataclass, field
from typing import Protocol

from mooncake.transfer.contract import SELF_CHECKED
from mooncake.transfer.framing import digest_of


class Lender(Protocol):
    """Shared memory that lends ranges: the store (mooncake/store/store.py) or an shm endpoint."""

    lendable_bytes: int  # how much it could lend in all; a window is at most a share of it

    def reserve(self, size: int) -> int | None:
        """Offset of `size` bytes set aside for a writer, or None if it cannot make room."""

    def reserved_view(self, offset: int, size: int) -> memoryview: ...

    def adopt(self, key: int, offset: int, size: int, checksum: int, position: int) -> str | None:
        """Take a written and verified range as block `key` (`position`: its place in its put). None when
        taken, or when the key is already held (a no-op); else why not. A range not taken the lender
        releases itself."""

    def release_reserved(self, offset: int, size: int) -> None: ...


class UnknownWindow(KeyError):
    """A commit to a window this node does not have (closed, expired, or from before a restart)."""


@dataclass
class _Window:
    offset: int
    size: int
    expires: float
    taken: list[tuple[int, int]] = field(default_factory=list)  # committed ranges (offset, size), sorted
    taken_bytes: int = 0

    def holds(self, offset: int, size: int) -> bool:
        return self.offset <= offset and offset + size <= self.offset + self.size and size > 0

    def overlaps(self, offset: int, size: int) -> bool:
        """Whether the range meets one already taken: only its neighbours in offset order can (a window
        of small blocks holds thousands)."""
        i = bisect.bisect_left(self.taken, (offset, 0))
        after = i < len(self.taken) and self.taken[i][0] < offset + size
        return after or (i > 0 and self.taken[i - 1][0] + self.taken[i - 1][1] > offset)

    def take(self, offset: int, size: int) -> None:
        bisect.insort(self.taken, (offset, size))
        self.taken_bytes += size


class WriteWindows:
    # A window is at most 1/32 of what the lender could lend (unless one block needs more): for a cache
    # node, lent bytes are bytes the cache does not hold, so several writers together must not take much
    # of it, nor an idle one long.
    MAX_SHARE = 32

    def __init__(self, lender: Lender, ttl_s: float = 10.0, clock=time.monotonic, max_share: int = MAX_SHARE):
        self.lender = lender
        self.max_share = max_share
        self.ttl_s = ttl_s
        self.clock = clock
        self._windows: dict[int, _Window] = {}
        self._ids = itertools.count(1)

    def open(self, want: int, need: int) -> tuple[int, int, int] | None:
        """(window id, offset, size) of a new window: `want` bytes, capped at a share of the lender, but
        never under `need`; None when the lender cannot lend or make room."""
        self.expire()
        if not self.lender.lendable_bytes:
            return None
        size = max(need, min(want, self.lender.lendable_bytes // self.max_share))
        offset = self.lender.reserve(size)
        if offset is None:
            return None
        window_id = next(self._ids)
        self._windows[window_id] = _Window(offset, size, self.clock() + self.ttl_s)
        return window_id, offset, size

    def commit(self, window_id: int, blocks: list[tuple[int, int, int, int]]) -> list[str | None]:
        """Adopt blocks written in a window, each (key, offset, size, checksum); per block, None or why
        not. Raises UnknownWindow."""
        self.expire()
        window = self._windows.get(window_id)
        if window is None:
            raise UnknownWindow(window_id)
        window.expires = self.clock() + self.ttl_s
        errors = []
        for position, (key, offset, size, digest) in enumerate(blocks):
            if not window.holds(offset, size) or window.overlaps(offset, size):
                errors.append(f"range {offset}+{size} is outside the writer's window or already used")
                continue
            window.take(offset, size)
            if digest == SELF_CHECKED or digest_of(self.lender.reserved_view(offset, size), digest) != digest:
                self.lender.release_reserved(offset, size)
                errors.append("checksum mismatch: corrupted in transit")
                continue
            errors.append(self.lender.adopt(key, offset, size, digest, position))
        return errors

    def close(self, window_id: int) -> None:
        """Give back every byte of the window no block took."""
        window = self._windows.pop(window_id, None)
        if window is None:
            return
        cursor = window.offset
        for offset, size in window.taken + [(window.offset + window.size, 0)]:
            if offset > cursor:
                self.lender.release_reserved(cursor, offset - cursor)
            cursor = max(cursor, offset + size)

    def close_all(self) -> None:
        for window_id in list(self._windows):
            self.close(window_id)

    def __len__(self) -> int:
        return len(self._windows)

    def lent_bytes(self) -> int:
        """Bytes lent and not yet holding a block (for a cache node, DRAM it cannot cache in meanwhile)."""
        return sum(w.size - w.taken_bytes for w in self._windows.values())

    def expire(self) -> None:
        """Take back windows idle past their TTL (also done by every open and commit)."""
        now = self.clock()
        for window_id in [w for w, window in self._windows.items() if window.expires <= now]:
            self.close(window_id)

"""KVStore: the cache role's block store over a DRAM tier and an optional SSD tier.

Objects are immutable and keyed by chained prefix hash: a second put of a key is a no-op success. Reads
take a lease that keeps the block in place until released or expired. When DRAM is full the eviction
policy picks a victim that is not leased; it is demoted to SSD when there is one (and dropped from
there in turn), else dropped. A hit on SSD promotes the block back to DRAM. Every add and drop is
queued as an event for subscribers (the conductor's prefix index)."""

import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from mooncake.config import StoreConfig
from mooncake.errors import CapacityError
from mooncake.hashing import checksum
from mooncake.registry import load_backend
from mooncake.store.eviction import make_policy
from mooncake.store.tier import StorageTier


@dataclass(frozen=True)
class Lease:
    """A read: the block's bytes (zero-copy for DRAM), where they came from, and the lease to release."""

    key: int
    data: memoryview | bytes
    tier: str
    lease_id: int


@dataclass(frozen=True)
class StoreEvent:
    kind: str  # "add" (the store now holds the key) | "evict" (it no longer does)
    key: int
    tier: str


@dataclass
class StoreMetrics:
    hits: Counter = field(default_factory=Counter)  # per tier
    misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: Counter = field(default_factory=Counter)  # per tier
    demotions: int = 0
    promotions: int = 0


class KVStore:
    def __init__(self, config: StoreConfig, clock: Callable[[], float] = time.monotonic,
                 tiers: list[StorageTier] | None = None, shared_dram: bool = False):
        if tiers is None:  # NOTE: by name, through the registry, as every backend
            tiers = [load_backend("storage", "dram")(config.dram_bytes, shared=shared_dram)]
            if config.ssd_dir:
                tiers.append(load_backend("storage", "ssd")(config.ssd_dir, config.ssd_bytes, fsync=config.ssd_fsync))
        self.config = config
        self.clock = clock
        self.tiers = tiers  # fastest first; a block lives in exactly one
        self.policies = {t.name: make_policy(config.eviction) for t in tiers}
        for tier in tiers:  # blocks recovered from disk count as present
            for key in tier.keys():
                self.policies[tier.name].touch(key)
        self.metrics = StoreMetrics()
        self._events: list[StoreEvent] = []
        self._lease_ids = itertools.count(1)
        self._leases: dict[int, tuple[int, float]] = {}  # lease id -> (key, expiry)
        self._lease_expiry: list[tuple[float, int]] = []
        self._leased = Counter()  # key -> live leases
        self._sums: dict[int, int] = {}  # key -> xxh3 of its bytes, once known (objects are immutable)
        # Keys removed while leased: they go when their last lease ends, and a put of one meanwhile is kept
        # (key -> (data, position, checksum)) to take its place then.
        self._doomed: dict[int, tuple | None] = {}

    # -- writes -----------------------------------------------------------------------------------

    def put(self, key: int, data, position: int = 0, checksum: int | None = None) -> None:
        """Store an immutable block; a key already held is a no-op. `position` is the block's index in
        its prompt (for length-aware eviction); `checksum`, when the caller verified one (or
        SELF_CHECKED, for a block its consumer checks), is kept so readers can be given it without hashing
        again. Raises CapacityError if no tier can make room."""
        if self._tier_of(key) is not None:
            if key in self._doomed:  # the held copy goes once read: this one replaces it then
                self._doomed[key] = (bytes(memoryview(data).cast("B")), position, checksum)
            return
        if checksum is not None:
            self._sums[key] = checksum
        self._expire_leases()
        size = len(memoryview(data).cast("B"))
        for tier in self.tiers:
            if size <= tier.capacity_bytes and self._store_in(tier, key, data, position):
                self.metrics.bytes_in += size
                self._events.append(StoreEvent("add", key, tier.name))
                return
        self._sums.pop(key, None)
        raise CapacityError(f"store full: cannot place a {size}-byte block; every tier's blocks are leased "
                            f"or the block is larger than a tier")

    # -- writes in place (a shared DRAM tier lends ranges to same-host writers: windows.py) ---------

    def reserve(self, size: int) -> int | None:
        """Offset of `size` bytes of the DRAM tier set aside for a writer, evicting unleased blocks to
        make room; None if the tier cannot write in place or cannot make room."""
        top = self.tiers[0]
        if top.path is None or size > top.capacity_bytes:
            return None
        self._expire_leases()
        policy = self.policies[top.name]
        while (offset := top.reserve(size)) is None:
            victim = policy.victim(can_evict=lambda k: not self._leased[k])
            if victim is None:
                return None
            self._evict(top, victim)
        return offset

    def reserved_view(self, offset: int, size: int) -> memoryview:
        return self.tiers[0].view_of(offset, size)

    @property
    def lendable_bytes(self) -> int:
        """DRAM a writer may be lent ranges of (mooncake/transfer/windows.py): all of a shared tier."""
        top = self.tiers[0]
        return top.capacity_bytes if top.path is not None else 0

    def adopt(self, key: int, offset: int, size: int, checksum: int, position: int = 0) -> None:
        """Make a reserved range, written and verified, block `key` of the DRAM tier. If the key is
        already held (a put of a held key is a no-op) the range is released instead."""
        if self._tier_of(key) is not None:
            if key in self._doomed:
                self._doomed[key] = (bytes(self.reserved_view(offset, size)), position, checksum)
            self.release_reserved(offset, size)
            return None
        top = self.tiers[0]
        top.adopt(key, offset, size)
        self._sums[key] = checksum
        self.policies[top.name].touch(key, position)
        self.metrics.bytes_in += size
        self._events.append(StoreEvent("add", key, top.name))
        return None

    def release_reserved(self, offset: int, size: int) -> None:
        self.tiers[0].release(offset, size)

    def remove(self, key: int) -> bool:
        """Drop a block (one a reader found corrupted, say): now, or, while leases hold it, as soon as the
        last one ends; a put of the key meanwhile is kept and takes its place then. False if absent."""
        self._expire_leases()
        tier = self._tier_of(key)
        if tier is None:
            return False
        if self._leased[key]:
            self._doomed.setdefault(key, None)
        else:
            self._drop(tier, key)
        return True

    # -- reads ------------------------------------------------------------------------------------

    def get(self, key: int, lease_s: float | None = None) -> Lease | None:
        """The block with a lease (release it when done), or None on a miss. An SSD hit is promoted."""
        self._expire_leases()
        tier = self._tier_of(key)
        if tier is None:
            self.metrics.misses += 1
            return None
        data = tier.get(key)
        if data is None:  # the tier found its copy corrupt and dropped it
            self._forget(tier, key)
            self.metrics.misses += 1
            return None
        self.metrics.hits[tier.name] += 1
        if tier is not self.tiers[0]:
            tier = self._promote(tier, key, data)
            data = tier.get(key) if tier is self.tiers[0] else data
        self.policies[tier.name].touch(key)
        self.metrics.bytes_out += len(data)
        lease_id = next(self._lease_ids)
        expiry = self.clock() + (lease_s if lease_s is not None else self.config.lease_s)
        self._leases[lease_id] = (key, expiry)
        heapq.heappush(self._lease_expiry, (expiry, lease_id))
        self._leased[key] += 1
        return Lease(key=key, data=data, tier=tier.name, lease_id=lease_id)

    def release(self, lease_id: int) -> None:
        entry = self._leases.pop(lease_id, None)
        if entry is not None:
            key = entry[0]
            self._leased[key] -= 1
            if not self._leased[key]:
                del self._leased[key]
                if key in self._doomed:
                    self._replace_doomed(key)

    def exists(self, key: int) -> str | None:
        """The name of the tier holding `key`, or None."""
        tier = self._tier_of(key)
        return None if tier is None else tier.name

    def match_prefix(self, keys: list[int]) -> list[str]:
        """Tier names of the leading run of `keys` held here (its length is the prefix hit)."""
        found = []
        for key in keys:
            tier = self._tier_of(key)
            if tier is None:
                break
            found.append(tier.name)
        return found

    def checksum_of(self, key: int, data) -> int:
        """The block's checksum: remembered from its put, or computed once and remembered."""
        digest = self._sums.get(key)
        if digest is None:
            digest = self._sums[key] = checksum(data)
        return digest

    def dram_location(self, key: int) -> tuple[str, int, int] | None:
        """(shared-memory file, offset, size) of a block in a shared DRAM tier, else None."""
        return self.tiers[0].location(key)

    def num_leased(self) -> int:
        """Blocks some live lease pins (expired leases are let go first)."""
        self._expire_leases()
        return sum(1 for n in self._leased.values() if n > 0)

    def drain_events(self) -> list[StoreEvent]:
        events, self._events = self._events, []
        return events

    def keys(self) -> list[int]:
        """Every key held, in any tier (those recovered from SSD at start included)."""
        return [key for tier in self.tiers for key in tier.keys()]

    def num_blocks(self) -> dict[str, int]:
        return {t.name: len(self.policies[t.name]) for t in self.tiers}

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

    # -- internals --------------------------------------------------------------------------------

    def _tier_of(self, key: int) -> StorageTier | None:
        return next((t for t in self.tiers if key in t), None)

    def _store_in(self, tier: StorageTier, key: int, data, position: int) -> bool:
        """Put into `tier`, evicting unleased blocks from it until the block fits."""
        policy = self.policies[tier.name]
        while not tier.put(key, data):
            victim = policy.victim(can_evict=lambda k: not self._leased[k])
            if victim is None:
                return False
            self._evict(tier, victim)
        policy.touch(key, position)
        return True

    def _evict(self, tier: StorageTier, key: int) -> None:
        self.metrics.evictions[tier.name] += 1
        below = self.tiers[self.tiers.index(tier) + 1:]
        if below:
            data = bytes(tier.get(key))
            self._forget(tier, key, announce=False)
            tier.remove(key)
            if self._store_in(below[0], key, data, 0):
                self.metrics.demotions += 1
                return
            self._events.append(StoreEvent("evict", key, tier.name))
            self._sums.pop(key, None)
            return
        self._drop(tier, key)

    def _promote(self, tier: StorageTier, key: int, data) -> StorageTier:
        top = self.tiers[0]
        data = bytes(data)
        self._forget(tier, key, announce=False)
        tier.remove(key)
        if self._store_in(top, key, data, 0):
            self.metrics.promotions += 1
            return top
        tier.put(key, data)  # DRAM is all leased: keep serving from where it was
        self.policies[tier.name].touch(key)
        return tier

    def _replace_doomed(self, key: int) -> None:
        """A removed block's last lease has ended: drop it, and put what was put meanwhile, if anything."""
        replacement = self._doomed.pop(key)
        tier = self._tier_of(key)
        if tier is not None:
            self._drop(tier, key)
        if replacement is not None:
            data, position, digest = replacement
            try:
                self.put(key, data, position, digest)
            except CapacityError:
                pass  # as any put that finds the store full: the block is simply not cached

    def _drop(self, tier: StorageTier, key: int) -> None:
        tier.remove(key)
        self._forget(tier, key)

    def _forget(self, tier: StorageTier, key: int, announce: bool = True) -> None:
        self.policies[tier.name].remove(key)
        if announce:
            self._events.append(StoreEvent("evict", key, tier.name))
            self._sums.pop(key, None)

    def _expire_leases(self) -> None:
        now = self.clock()
        while self._lease_expiry and self._lease_expiry[0][0] <= now:
            _, lease_id = heapq.heappop(self._lease_expiry)
            self.release(lease_id)

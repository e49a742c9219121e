"""Eviction policies: which cached block to give up when a tier is full. Pure: no I/O, no clock; the
store (and scripts/cache_hit.py, and later the simulator) call them.

Every policy sees the same calls: `touch(key, position)` on insert and on every hit (`position` is the
block's index in the prompt that touched it), `remove(key)` when the key leaves the tier, and
`victim(can_evict)` for the key to evict next, skipping keys the caller cannot evict (leased, in flight)."""

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable

from mooncake.registry import load_backend


class EvictionPolicy(ABC):
    @abstractmethod
    def touch(self, key: Hashable, position: int = 0) -> None: ...

    @abstractmethod
    def remove(self, key: Hashable) -> None: ...

    @abstractmethod
    def victim(self, can_evict: Callable[[Hashable], bool] = lambda key: True) -> Hashable | None:
        """The next key to evict (still tracked until `remove`), or None if no key can be evicted."""

    @abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used first (the paper's finding for its trace, and our default)."""

    def __init__(self):
        self._order: OrderedDict = OrderedDict()

    def touch(self, key, position=0):
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key):
        self._order.pop(key, None)

    def victim(self, can_evict=lambda key: True):
        return next((key for key in self._order if can_evict(key)), None)

    def __len__(self):
        return len(self._order)


class _HeapPolicy(EvictionPolicy):
    """A min-heap of (priority, key) with lazy deletion: stale entries are skipped when they surface."""

    def __init__(self):
        self._heap: list = []
        self._current: dict = {}  # key -> its live heap entry
        self._tick = itertools.count()

    @abstractmethod
    def _priority(self, key, position: int, tick: int) -> tuple: ...

    def touch(self, key, position=0):
        entry = (*self._priority(key, position, next(self._tick)), key)
        self._current[key] = entry
        heapq.heappush(self._heap, entry)

    def remove(self, key):
        self._current.pop(key, None)

    def victim(self, can_evict=lambda key: True):
        skipped, found = [], None
        while self._heap:
            entry = heapq.heappop(self._heap)
            key = entry[-1]
            if self._current.get(key) is not entry:
                continue  # stale
            skipped.append(entry)
            if can_evict(key):
                found = key
                break
        for entry in skipped:  # the victim stays tracked until the caller removes it
            heapq.heappush(self._heap, entry)
        if len(self._heap) > 4 * len(self._current) + 64:
            self._heap = list(self._current.values())
            heapq.heapify(self._heap)
        return found

    def __len__(self):
        return len(self._current)


class LFUPolicy(_HeapPolicy):
    """Fewest hits first; ties go to the least recently used."""

    def __init__(self):
        super().__init__()
        self._hits: dict = {}

    def _priority(self, key, position, tick):
        self._hits[key] = self._hits.get(key, 0) + 1
        return (self._hits[key], tick)

    def remove(self, key):
        super().remove(key)
        self._hits.pop(key, None)


class LengthAwarePolicy(_HeapPolicy):
    """Blocks that sit late in prompts first (a late block is only reusable by a longer shared prefix);
    ties go to the least recently used. A block's position is the earliest it was seen at."""

    def __init__(self):
        super().__init__()
        self._position: dict = {}

    def _priority(self, key, position, tick):
        self._position[key] = min(position, self._position.get(key, position))
        return (-self._position[key], tick)

    def remove(self, key):
        super().remove(key)
        self._position.pop(key, None)


def make_policy(name: str) -> EvictionPolicy:
    """The eviction policy registered as `name` (mooncake/registry.py)."""
    return load_backend("eviction", name)()

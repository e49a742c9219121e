"""The global prefix index: which holders (prefill instances, cache nodes) have which blocks. Fed by
store and instance events; queried by the placement policies. Holder ids are strings."""

from collections.abc import Iterable


class PrefixIndex:
    def __init__(self):
        self._holders: dict[int, set[str]] = {}
        self._counts: dict[str, int] = {}  # blocks per holder

    def __len__(self) -> int:
        return len(self._holders)

    def count(self, holder: str) -> int:
        """How many blocks `holder` has in the index."""
        return self._counts.get(holder, 0)

    def counts(self) -> dict[str, int]:
        """Blocks per holder."""
        return dict(self._counts)

    def add(self, holder: str, hashes: Iterable[int]) -> None:
        for h in hashes:
            holders = self._holders.setdefault(h, set())
            if holder not in holders:
                holders.add(holder)
                self._counts[holder] = self._counts.get(holder, 0) + 1

    def remove(self, holder: str, hashes: Iterable[int]) -> None:
        for h in hashes:
            holders = self._holders.get(h)
            if holders is not None and holder in holders:
                holders.discard(holder)
                self._counts[holder] -= 1
                if not holders:
                    del self._holders[h]

    def drop_holder(self, holder: str) -> None:
        """A holder died or left: forget everything it had."""
        for h in [h for h, hs in self._holders.items() if holder in hs]:
            self.remove(holder, [h])
        self._counts.pop(holder, None)

    def holders(self, block_hash: int) -> set[str]:
        return self._holders.get(block_hash, set())

    def prefix_len(self, hashes: Iterable[int], holder: str) -> int:
        """Leading blocks of `hashes` that `holder` has."""
        n = 0
        for h in hashes:
            if holder not in self._holders.get(h, ()):
                break
            n += 1
        return n

    def prefix_lengths(self, hashes: Iterable[int]) -> dict[str, int]:
        """Leading blocks of `hashes` per holder that has at least the first one, in one pass."""
        lengths: dict[str, int] = {}
        alive: set[str] | None = None
        i = 0
        for i, h in enumerate(hashes):
            here = self._holders.get(h, set())
            if alive is None:
                alive = set(here)
            else:
                for holder in alive - here:
                    lengths[holder] = i
                alive &= here
            if not alive:
                return lengths
        for holder in alive or ():
            lengths[holder] = i + 1
        return lengths


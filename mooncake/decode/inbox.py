"""A decode instance's KV inbox: the BlockService its transport serves, where prefill instances push a
request's blocks before the conductor sends the `Decode` that claims them. Blocks are keyed by hash and
counted, so two requests sharing a prefix can both claim it; what nobody claims expires. The inbox holds
at most `max_bytes`: a block past that is refused (the sender reports it), never buffered without bound."""

import time

TOMBSTONE_S = 10.0  # how long a released block that had not arrived yet is waited for, to be dropped


class KVInbox:
    keeps_blocks = True  # transports hand over block bytes it may hold (mooncake/transfer/contract.py)

    def __init__(self, ttl_s: float, max_bytes: int = 1 << 30):
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._blocks: dict[int, list] = {}  # hash -> [block bytes, copies pending, arrival time]
        self._tombstones: dict[int, tuple[int, float]] = {}  # hash -> (late copies to drop, until when)

    def __len__(self) -> int:
        return len(self._blocks)

    def put_block(self, key: int, data) -> str | None:
        if (tomb := self._tombstones.pop(key, None)) is not None:
            count, until = tomb
            if count > 1:
                self._tombstones[key] = (count - 1, until)
            if until >= time.monotonic():
                return None  # the copy of a cancelled request, late: taken and dropped
        entry = self._blocks.get(key)
        if entry is None:
            size = memoryview(data).nbytes
            if self.num_bytes + size > self.max_bytes:
                return (f"the KV inbox is full ({self.num_bytes} of {self.max_bytes} bytes held; "
                        f"instance.kv_inbox_bytes sets the limit)")
            self.num_bytes += size
            self._blocks[key] = [data, 1, time.monotonic()]
        else:
            entry[1] += 1
            entry[2] = time.monotonic()
        return None

    def get_block(self, key: int):
        return None  # nobody reads from a decode inbox over the network

    def claim(self, keys: list[int]) -> list[bytes | memoryview]:
        """The leading run of `keys` present, one copy each taken out of the inbox."""
        found = []
        for key in keys:
            entry = self._blocks.get(key)
            if entry is None:
                break
            found.append(entry[0])
            entry[1] -= 1
            if entry[1] <= 0:
                self._drop(key)
        return found

    def release(self, keys: list[int]) -> int:
        """Give back one copy of each of `keys` (a cancelled request's unclaimed blocks); how many blocks
        left the inbox. A key not here yet is still on its way: its copy is dropped when it arrives within
        TOMBSTONE_S. NOTE: should another request push the same block first, that copy is the one dropped,
        and that request computes the block instead of importing it: slower, never wrong."""
        before = len(self._blocks)
        now = time.monotonic()
        for key in keys:
            entry = self._blocks.get(key)
            if entry is None:
                count, _ = self._tombstones.get(key, (0, 0.0))
                self._tombstones[key] = (count + 1, now + TOMBSTONE_S)
                continue
            entry[1] -= 1
            if entry[1] <= 0:
                self._drop(key)
        return before - len(self._blocks)

    def expire(self) -> int:
        """Drop blocks nobody claimed within the TTL; how many went."""
        cutoff = time.monotonic() - self.ttl_s
        stale = [k for k, (_, _, t) in self._blocks.items() if t < cutoff]
        for key in stale:
            self._drop(key)
        now = time.monotonic()
        self._tombstones = {k: v for k, v in self._tombstones.items() if v[1] >= now}
        return len(stale)

    def _drop(self, key: int) -> None:
        self.num_bytes -= memoryview(self._blocks.pop(key)[0]).nbytes

"""A decode instance's KV inbox: the BlockService its transport serves, where prefill instances push a
request's blocks before the conductor sends the `Decode` that claims them. Blocks are keyed by hash and
counted, so two requests sharing a prefix can both claim it; what nobody claims expires. The inbox holds
at most `max_bytes`: a block past that is refused (the sender reports it), never buffered without bound."""

import time


class KVInbox:
    keeps_blocks = True  # transports hand over block bytes it may hold (mooncake/transfer/contract.py)

    def __init__(self, ttl_s: float, max_bytes: int = 1 << 30):
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._blocks: dict[int, list] = {}  # hash -> [block bytes, copies pending, arrival time]

    def __len__(self) -> int:
        return len(self._blocks)

    def put_block(self, key: int, data) -> str | None:
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
        """Give back one copy of each of `keys` present (a cancelled request's unclaimed blocks); how many
        blocks left the inbox. NOTE: a block still on its way when the cancel came arrives later and waits
        for the TTL; a tombstone would instead drop the same prefix block of another request."""
        before = len(self._blocks)
        for key in keys:
            entry = self._blocks.get(key)
            if entry is not None:
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
        return len(stale)

    def _drop(self, key: int) -> None:
        self.num_bytes -= memoryview(self._blocks.pop(key)[0]).nbytes

"""A decode instance's KV inbox: the BlockService its transport serves, where prefill instances push a
request's blocks before the conductor sends the `Decode` that claims them. Blocks are keyed by hash and
counted, so two requests sharing a prefix can both claim it; what nobody claims expires."""

import time


class KVInbox:
    keeps_blocks = True  # transports hand over block bytes it may hold (mooncake/transfer/contract.py)

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._blocks: dict[int, list] = {}  # hash -> [block bytes, copies pending, arrival time]

    def __len__(self) -> int:
        return len(self._blocks)

    def put_block(self, key: int, data) -> str | None:
        entry = self._blocks.get(key)
        if entry is None:
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
                del self._blocks[key]
        return found

    def expire(self) -> int:
        """Drop blocks nobody claimed within the TTL; how many went."""
        cutoff = time.monotonic() - self.ttl_s
        stale = [k for k, (_, _, t) in self._blocks.items() if t < cutoff]
        for key in stale:
            del self._blocks[key]
        return len(stale)

"""A decode instance's KV inbox: the BlockService its transport serves, where prefill instances push a
request's blocks before the conductor sends the `Decode` that claims them. Blocks are keyed by hash and
counted, so two requests sharing a prefix can both claim it; what nobody claims expires. The inbox holds
at most `max_bytes`: a block past that is refused (the sender reports it), never buffered without bound.

A cancelled request's unclaimed copies are released at once (`release`). A copy of it still on its way
then lands uncounted: it stays claimable (another request, or the same request's next leg after a
migration, may push and claim the same block) but expires after ORPHAN_TTL_S instead of the inbox TTL."""

import time

from mooncake.hashing import layer_key
from mooncake.transfer.contract import BlockService

ORPHAN_TTL_S = 3.0  # an uncounted copy (of a cancelled request, landed late) waits this long for a claim
RELEASED_S = 10.0  # how long a release waits for a copy still on its way
HAND_OFF_S = 10.0  # from a leg's last prefill step to decode's claim of its blocks, at most (with margin)


def inbox_ttl_s(config) -> float:
    """How long unclaimed KV waits: instance.kv_inbox_ttl_s, or (0) as long as a leg's prefill may take. A
    leg's first chunk's blocks arrive when its prefill starts and are claimed after its last: a TTL shorter
    than a long prompt's prefill dropped them, and decode computed the whole prompt again on its own core."""
    return config.instance.kv_inbox_ttl_s or config.conductor.prefill_timeout_s + HAND_OFF_S


class KVInbox(BlockService):
    keeps_blocks = True  # transports hand over block bytes it may hold

    def __init__(self, ttl_s: float, max_bytes: int = 1 << 30):
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._blocks: dict[int, list] = {}  # hash -> [block bytes, copies counted, expiry time]
        self._released: dict[int, tuple[int, float]] = {}  # hash -> (copies on their way to uncount, until)

    def __len__(self) -> int:
        return len(self._blocks)

    def put_block(self, key: int, data, checksum: int | None = None) -> str | None:
        now = time.monotonic()
        counted = not self._take_release(key, now)
        entry = self._blocks.get(key)
        if entry is None:
            size = memoryview(data).nbytes
            if self.num_bytes + size > self.max_bytes:
                return (f"the KV inbox is full ({self.num_bytes} of {self.max_bytes} bytes held; "
                        f"instance.kv_inbox_bytes sets the limit)")
            self.num_bytes += size
            entry = self._blocks[key] = [data, 0, now]
        if counted:
            entry[1] += 1
        entry[2] = max(entry[2], now + (self.ttl_s if counted else ORPHAN_TTL_S))
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

    def claim_blocks(self, block_hashes: list[int], num_layers: int) -> list[bytes | memoryview]:
        """The leading run of blocks present, each as it came: whole (one payload, under its hash) or by
        layer (one payload per layer, under `layer_key`s); one copy of each taken out of the inbox."""
        found = []
        for block_hash in block_hashes:
            keys = [block_hash]
            if block_hash not in self._blocks:
                keys = [layer_key(block_hash, layer) for layer in range(num_layers)]
                if not all(key in self._blocks for key in keys):
                    break
            found.extend(self.claim(keys))
        return found

    def release_blocks(self, block_hashes: list[int], num_layers: int) -> int:
        """`release` of a cancelled request's blocks, each under the keys it came by: its hash, or its
        layers' keys when some are here. A block none of whose keys is here yet may still come either way
        (whole, by layer from a layer-streaming prefill or a CPP group's stages): both are expected."""
        keys = []
        for block_hash in block_hashes:
            layers = [layer_key(block_hash, layer) for layer in range(num_layers)]
            if block_hash in self._blocks:
                keys.append(block_hash)
            elif any(key in self._blocks for key in layers):
                keys.extend(layers)
            else:
                keys.extend([block_hash, *layers])
        return self.release(keys)

    def release(self, keys: list[int]) -> int:
        """Give back one copy of each of `keys` (a cancelled request's unclaimed blocks); how many blocks
        left the inbox. A key with no counted copy here is still on its way: it will land uncounted."""
        before = len(self._blocks)
        now = time.monotonic()
        for key in keys:
            entry = self._blocks.get(key)
            if entry is None or entry[1] <= 0:
                count, _ = self._released.get(key, (0, 0.0))
                self._released[key] = (count + 1, now + RELEASED_S)
                continue
            entry[1] -= 1
            if entry[1] <= 0:
                self._drop(key)
        return before - len(self._blocks)

    def expire(self) -> int:
        """Drop blocks past their expiry (nobody claimed them in time); how many went."""
        now = time.monotonic()
        stale = [k for k, (_, _, until) in self._blocks.items() if until < now]
        for key in stale:
            self._drop(key)
        self._released = {k: v for k, v in self._released.items() if v[1] >= now}
        return len(stale)

    def _take_release(self, key: int, now: float) -> bool:
        released = self._released.pop(key, None)
        if released is None:
            return False
        count, until = released
        if count > 1:
            self._released[key] = (count - 1, until)
        return until >= now

    def _drop(self, key: int) -> None:
        self.num_bytes -= memoryview(self._blocks.pop(key)[0]).nbytes

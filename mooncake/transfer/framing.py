"""Wire framing shared by the message-based transports: a MAC frame (under the cluster key,
mooncake/security.py; empty without keys), a binding frame (who sent it, its count, when), a msgpack header
frame, then one frame per block.
Headers carry the op, the request id, keys, sizes and xxh3 checksums; the receiver of data verifies
every block before using it. An encoded KV payload's digest is its `bound_digest` (negative): the receiver
checks that it matches, and the payload's consumer checks its bytes, so every byte is under the seal.

`tamper` is a fault-injection hook for tests: applied to outgoing block bytes after checksumming."""

import struct
import time
from collections.abc import Callable

import msgpack

from mooncake import security
from mooncake.hashing import checksum
from mooncake.kv_payload import bound_digest
from mooncake.transfer.contract import SELF_CHECKED, BlockResult

WIRE_VERSION = 4  # 2: checksums two-level above one chunk (mooncake/hashing.py); 3: a MAC frame first;
# 4: a binding frame after it (sender, counter, time) and payloads' bound digests instead of SELF_CHECKED
# NOTE: a message is [MAC, binding, header, block...]. The MAC (mooncake/security.py `seal`; empty without
# keys) covers the binding, the receiver's address and the header; the header names every block's checksum
# or bound digest. So a sealed message is good for one receiver, once, and for its own bytes only.
Tamper = Callable[[int, bytes], bytes] | None
_BINDING = struct.Struct("<8sQd")  # the sender endpoint's random id, its counter towards this peer, its clock
REPLAY_WINDOW_S = 3600.0  # a message older (or newer) than this by the receiver's clock is refused
CLOCK_SKEW_S = 1.0  # how far the hosts' clocks may differ (NTP keeps them within milliseconds)
REPLY = "reply from "  # what a reply is bound to: its sender's address, as its receiver knows it


def binding(sender_id: bytes, counter: int, at: float | None = None) -> bytes:
    return _BINDING.pack(sender_id, counter, time.time() if at is None else at)


def seal_for(bind, receiver: str, header) -> bytes:
    """The MAC of a message for `receiver` (an address, or REPLY + one)."""
    return security.seal(bytes(bind) + receiver.encode() + bytes(header))


def is_sealed_for(mac, bind, receiver: str, header) -> bool:
    return security.is_sealed(mac, bytes(bind) + receiver.encode() + bytes(header))


class ReplayGuard:
    """Admits each sealed message once: per sender endpoint, counters only grow (one connection keeps its
    messages in order), and a message from outside the time window is refused, so one from a sender the
    guard has forgotten cannot come back either. Nor can one sealed before the guard started (less
    CLOCK_SKEW_S): a receiver restarted on the same address has forgotten what its predecessor admitted."""

    def __init__(self, window_s: float = REPLAY_WINDOW_S, clock=time.time):
        self.window_s, self.clock = window_s, clock
        self.started_s = clock()
        self._last: dict[bytes, tuple[int, float]] = {}  # sender id -> (its highest counter, when seen)
        self._next_prune = 0.0

    def admit(self, bind) -> str | None:
        """None if the message is fresh; else why not."""
        try:
            sender, counter, sent_at = _BINDING.unpack(bytes(bind))
        except struct.error:
            return "malformed binding"
        now = self.clock()
        if abs(now - sent_at) > self.window_s:
            return f"sent {now - sent_at:+.0f} s from now: replayed, or the clocks differ by over {self.window_s:g} s"
        if sent_at < self.started_s - CLOCK_SKEW_S:
            return (f"sealed {self.started_s - sent_at:.1f} s before this receiver started: replayed, or the "
                    f"sender's clock is behind by over {CLOCK_SKEW_S:g} s (keep the hosts' clocks in sync)")
        last = self._last.get(sender)
        if last is not None and counter <= last[0]:
            return "replayed"
        self._last[sender] = (counter, now)
        if now > self._next_prune:
            self._next_prune = now + self.window_s
            self._last = {k: v for k, v in self._last.items() if now - v[1] <= 2 * self.window_s}
        return None


def pack_header(op: str, request_id: str, **fields) -> bytes:
    return msgpack.packb({"v": WIRE_VERSION, "op": op, "id": request_id, **fields})


def unpack_header(frame) -> dict:
    header = msgpack.unpackb(bytes(frame))
    if isinstance(header, dict) and "op" in header and header.get("v") != WIRE_VERSION:
        raise ValueError(f"peer speaks wire version {header.get('v')!r}; this build speaks {WIRE_VERSION} "
                         f"(run one mooncake version on every node)")
    if not isinstance(header, dict) or "op" not in header:
        raise ValueError(f"unsupported or malformed header: {header!r:.80}")
    return header


def block_frames(blocks: list[tuple[int, bytes | memoryview]], tamper: Tamper = None,
                 sums: list[int] | None = None):
    """(keys, sizes, checksums, data frames) for a list of blocks. `sums`, where given, are the blocks'
    checksums already known (or SELF_CHECKED): no hashing here."""
    keys, sizes, frames = [], [], []
    for key, data in blocks:
        view = memoryview(data).cast("B")
        keys.append(key)
        sizes.append(len(view))
        frames.append(tamper(key, bytes(view)) if tamper else view)
    if sums is None:
        sums = [checksum(memoryview(data).cast("B")) for _, data in blocks]
    return keys, sizes, list(sums), frames


def self_checked_sums(blocks: list, self_checked: bool) -> list[int] | None:
    """The checksum field of blocks sent with `self_checked` (each payload's `bound_digest`: read, not
    hashed), or None (the transport hashes them)."""
    return [bound_digest(data) for _, data in blocks] if self_checked else None


def digest_of(view, digest: int) -> int:
    """What `view` must match for a header's `digest`: its bound digest (a payload's) when that is
    negative, else its checksum."""
    return bound_digest(view) if digest < 0 else checksum(view)


def verify_blocks(keys, sums, frames, digests=None) -> list[BlockResult]:
    """A result per block: the data if its checksum matches, else a checksum error (data withheld).
    `digests`, where given, are the frames' checksums already computed (by `copy_checked`)."""
    results = []
    for i, (key, digest, frame) in enumerate(zip(keys, sums, frames)):
        view = memoryview(frame).cast("B") if not isinstance(frame, memoryview) else frame
        if digest is None:
            results.append(BlockResult(key, error="not found"))
        elif digest == SELF_CHECKED:  # NOTE: binds no byte to the seal: a replayed header could carry any
            results.append(BlockResult(key, error="unbound block (SELF_CHECKED): refused"))
        elif (digest_of(view, digest) if digests is None or digests[i] is None else digests[i]) != digest:
            results.append(BlockResult(key, error="checksum mismatch: corrupted or forged in transit"))
        else:  # a payload (negative digest) is then checked byte by byte by its consumer
            results.append(BlockResult(key, data=view))
    return results

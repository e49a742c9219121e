"""Wire framing shared by the message-based transports: a MAC frame (the header's, under the cluster
key, mooncake/security.py; empty without keys), a msgpack header frame, then one frame per block.
Headers carry the op, the request id, keys, sizes and xxh3 checksums; the receiver of data verifies
every block before using it, except those whose checksum reads SELF_CHECKED (their consumer does).

`tamper` is a fault-injection hook for tests: applied to outgoing block bytes after checksumming."""

from collections.abc import Callable

import msgpack

from mooncake.hashing import checksum
from mooncake.transfer.contract import SELF_CHECKED, BlockResult

WIRE_VERSION = 3  # 2: checksums two-level above one chunk (mooncake/hashing.py); 3: a MAC frame first
# NOTE: a message is [MAC, header, block...]; the MAC (mooncake/security.py `seal`) is empty without keys.
Tamper = Callable[[int, bytes], bytes] | None


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
    """The checksum field of blocks sent with `self_checked`, or None (the transport hashes them)."""
    return [SELF_CHECKED] * len(blocks) if self_checked else None


def verify_blocks(keys, sums, frames, digests=None) -> list[BlockResult]:
    """A result per block: the data if its checksum matches, else a checksum error (data withheld).
    `digests`, where given, are the frames' checksums already computed (by `copy_checked`)."""
    results = []
    for i, (key, digest, frame) in enumerate(zip(keys, sums, frames)):
        view = memoryview(frame).cast("B") if not isinstance(frame, memoryview) else frame
        if digest is None:
            results.append(BlockResult(key, error="not found"))
        elif digest == SELF_CHECKED:  # its consumer verifies it
            results.append(BlockResult(key, data=view))
        elif (checksum(view) if digests is None or digests[i] is None else digests[i]) != digest:
            results.append(BlockResult(key, error="checksum mismatch: corrupted in transit"))
        else:
            results.append(BlockResult(key, data=view))
    return results

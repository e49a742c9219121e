"""The KV block payload every role moves (DESIGN section 4): one block's K and V, all layers or one,
laid out [layer][k|v][token][kv_head][dim], with its hash, model namespace, dtype, shape and checksum.

Wire form: u32 LE header length || u64 LE xxh3 of the header || msgpack header || raw bytes. The header
carries the raw bytes' checksum, and the header's own hash covers the header, so a payload is checked end
to end by its consumer alone: transports move it without hashing it again (`self_checked`,
mooncake/transfer/contract.py), and bind it to their sealed header by that header hash (`bound_digest`). `from_bytes` checks the header; `verify()` the bytes and the metadata.
A receiver treats a failure as a miss."""

import struct
from dataclasses import dataclass

import msgpack
import xxhash

from mooncake.errors import KVPayloadError
from mooncake.hashing import checksum, layer_key

PAYLOAD_VERSION = 2  # 2: the header's own hash after its length
_xxh3 = xxhash.xxh3_64_intdigest
_PREFIX = struct.Struct("<IQ")  # header length, xxh3-64 of the header


@dataclass(frozen=True)
class KVPayload:
    block_hash: int
    namespace: bytes
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    shape: tuple[int, ...]  # (layers, 2, tokens, kv_heads, head_dim), or (2, tokens, ...) for one layer
    layer: int | None  # None: every layer; else this layer's slice only
    checksum: int
    data: bytes | memoryview

    def verify(self, namespace: bytes | None = None, dtype: str | None = None,
               shape: tuple[int, ...] | None = None) -> None:
        """Raise KVPayloadError unless the bytes match the checksum and the expected metadata."""
        if namespace is not None and self.namespace != namespace:
            raise KVPayloadError(f"block {self.block_hash:#x}: namespace {self.namespace!r}, expected {namespace!r}")
        if dtype is not None and self.dtype != dtype:
            raise KVPayloadError(f"block {self.block_hash:#x}: dtype {self.dtype}, expected {dtype}")
        if shape is not None and tuple(self.shape) != tuple(shape):
            raise KVPayloadError(f"block {self.block_hash:#x}: shape {self.shape}, expected {shape}")
        if checksum(self.data) != self.checksum:
            raise KVPayloadError(f"block {self.block_hash:#x}: checksum mismatch (corrupted payload)")

    def header(self) -> bytes:
        return msgpack.packb({
            "v": PAYLOAD_VERSION, "hash": self.block_hash, "ns": self.namespace, "dtype": self.dtype,
            "shape": list(self.shape), "layer": self.layer, "checksum": self.checksum,
            "nbytes": len(self.data),
        })

    def to_bytes(self) -> bytes:
        header = self.header()
        return b"".join((_PREFIX.pack(len(header), _xxh3(header)), header, self.data))  # one copy of the data

    @classmethod
    def from_bytes(cls, buf: bytes | memoryview) -> "KVPayload":
        view = memoryview(buf)
        try:
            header_len, header_hash = _PREFIX.unpack_from(view, 0)
            header_bytes = view[_PREFIX.size:_PREFIX.size + header_len]
            if len(header_bytes) != header_len or _xxh3(header_bytes) != header_hash:
                raise KVPayloadError("KV payload header fails its check (corrupted, or written by another "
                                     "mooncake version)")
            header = msgpack.unpackb(header_bytes)
            version = header["v"]
            if version != PAYLOAD_VERSION:
                raise KVPayloadError(f"KV payload version {version}, this build reads {PAYLOAD_VERSION}")
            data = view[_PREFIX.size + header_len:]
            if len(data) != header["nbytes"]:
                raise KVPayloadError(f"KV payload truncated: {len(data)} of {header['nbytes']} bytes")
            return cls(block_hash=header["hash"], namespace=header["ns"], dtype=header["dtype"],
                       shape=tuple(header["shape"]), layer=header["layer"], checksum=header["checksum"],
                       data=data)
        except (struct.error, KeyError, ValueError, TypeError, msgpack.UnpackException) as exc:
            raise KVPayloadError(f"malformed KV payload: {exc}") from None


BOUND_MASK = (1 << 62) - 1


def bound_digest(block) -> int:
    """What a sealed transport header names for an encoded payload, binding its bytes to the seal at no
    cost: the payload header's own xxh3 (bytes 4..12), which covers the data's checksum, so a consumer that
    checks the payload (`from_bytes`, `verify`) checks every byte against the seal. Negative (at most -2),
    so no transport takes it for a checksum of the bytes; -2 for a block too short to be a payload."""
    view = memoryview(block).cast("B")
    if len(view) < _PREFIX.size:
        return -2
    return -2 - (struct.unpack_from("<Q", view, 4)[0] & BOUND_MASK)


def wire_blocks(payloads: list[KVPayload]) -> list[tuple[int, bytes]]:
    """Payloads as they go on the wire (run on a KV thread): whole blocks under their hash, one layer's
    slices under their layer keys (`hashing.layer_key`)."""
    return [(p.block_hash if p.layer is None else layer_key(p.block_hash, p.layer), p.to_bytes()) for p in payloads]

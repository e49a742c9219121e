"""The KV block payload every role moves (DESIGN section 4): one block's K and V, all layers or one,
laid out [layer][k|v][token][kv_head][dim], with its hash, model namespace, dtype, shape and checksum.

Wire form: u32 LE header length || msgpack header || raw bytes. A receiver calls `verify()` and treats
a failure as a miss."""

import struct
from dataclasses import dataclass

import msgpack

from mooncake.errors import KVPayloadError
from mooncake.hashing import checksum

PAYLOAD_VERSION = 1
_HEADER_LEN = struct.Struct("<I")


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
        return b"".join((_HEADER_LEN.pack(len(header)), header, self.data))  # one copy of the data

    @classmethod
    def from_bytes(cls, buf: bytes | memoryview) -> "KVPayload":
        view = memoryview(buf)
        try:
            (header_len,) = _HEADER_LEN.unpack_from(view, 0)
            header = msgpack.unpackb(view[4:4 + header_len])
            version = header["v"]
            if version != PAYLOAD_VERSION:
                raise KVPayloadError(f"KV payload version {version}, this build reads {PAYLOAD_VERSION}")
            data = view[4 + header_len:]
            if len(data) != header["nbytes"]:
                raise KVPayloadError(f"KV payload truncated: {len(data)} of {header['nbytes']} bytes")
            return cls(block_hash=header["hash"], namespace=header["ns"], dtype=header["dtype"],
                       shape=tuple(header["shape"]), layer=header["layer"], checksum=header["checksum"],
                       data=data)
        except (struct.error, KeyError, ValueError, TypeError, msgpack.UnpackException) as exc:
            raise KVPayloadError(f"malformed KV payload: {exc}") from None

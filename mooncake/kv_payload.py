"""The KV block payload every role moves (DESIGN section 4): one block's K and V, all layers or one,
laid out [layer][k|v][token][kv_head][dim], with its hash, model namespace, dtype, shape and MAC.

Wire form: u32 LE header length || u64 LE keyed digest of the header || msgpack header || raw bytes. The
header carries the raw bytes' MAC (AES-GMAC under the cluster's key, mooncake/kv_mac.py), and the header's
keyed digest covers the header, so a payload is checked end to end by its consumer alone, wherever it came
from (a transport, the pool, SSD): transports move it without hashing it again (`self_checked`,
mooncake/transfer/contract.py), and bind it to their sealed header by that header digest (`bound_digest`).
`from_bytes` checks the header; `verify()` the bytes and the metadata. A receiver treats a failure as a miss;
without the key nobody can make a payload that passes."""

import struct
from dataclasses import dataclass

import msgpack

from mooncake.errors import KVPayloadError
from mooncake.hashing import layer_key
from mooncake.kv_mac import data_mac, data_mac_ok, header_digest

PAYLOAD_VERSION = 3  # 2: the header's own hash after its length; 3: keyed (a MAC of the data, a keyed digest)
PREFIX = struct.Struct("<IQ")  # header length, keyed digest of the header


@dataclass(frozen=True)
class KVPayload:
    block_hash: int
    namespace: bytes
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    shape: tuple[int, ...]  # (layers, 2, tokens, kv_heads, head_dim), or (2, tokens, ...) for one layer
    layer: int | None  # None: every layer; else this layer's slice only
    mac: bytes  # kv_mac.data_mac of the data
    data: bytes | memoryview

    @classmethod
    def of(cls, block_hash: int, namespace: bytes, dtype: str, shape: tuple[int, ...], layer: int | None,
           data: bytes | memoryview) -> "KVPayload":
        """A payload of `data`, with its MAC (one pass over the bytes)."""
        return cls(block_hash, namespace, dtype, shape, layer, data_mac(data), data)

    def verify(self, namespace: bytes | None = None, dtype: str | None = None,
               shape: tuple[int, ...] | None = None) -> None:
        """Raise KVPayloadError unless the bytes match their MAC and the expected metadata."""
        if namespace is not None and self.namespace != namespace:
            raise KVPayloadError(f"block {self.block_hash:#x}: namespace {self.namespace!r}, expected {namespace!r}")
        if dtype is not None and self.dtype != dtype:
            raise KVPayloadError(f"block {self.block_hash:#x}: dtype {self.dtype}, expected {dtype}")
        if shape is not None and tuple(self.shape) != tuple(shape):
            raise KVPayloadError(f"block {self.block_hash:#x}: shape {self.shape}, expected {shape}")
        if not data_mac_ok(self.data, self.mac):
            raise KVPayloadError(f"block {self.block_hash:#x}: its bytes fail their MAC (corrupted, forged, or "
                                 f"made under another cluster's key)")

    def header(self) -> bytes:
        return msgpack.packb({
            "v": PAYLOAD_VERSION, "hash": self.block_hash, "ns": self.namespace, "dtype": self.dtype,
            "shape": list(self.shape), "layer": self.layer, "mac": self.mac,
            "nbytes": len(self.data),
        })

    def to_bytes(self) -> bytes:
        header = self.header()
        return b"".join((PREFIX.pack(len(header), header_digest(header)), header, self.data))  # one copy of the data

    @classmethod
    def from_bytes(cls, buf: bytes | memoryview) -> "KVPayload":
        view = memoryview(buf)
        try:
            header_len, header_hash = PREFIX.unpack_from(view, 0)
            header_bytes = view[PREFIX.size:PREFIX.size + header_len]
            if len(header_bytes) != header_len or header_digest(bytes(header_bytes)) != header_hash:
                raise KVPayloadError("KV payload header fails its check (corrupted, forged, made under another "
                                     "cluster's key, or written by another mooncake version)")
            header = msgpack.unpackb(header_bytes)
            version = header["v"]
            if version != PAYLOAD_VERSION:
                raise KVPayloadError(f"KV payload version {version}, this build reads {PAYLOAD_VERSION}")
            data = view[PREFIX.size + header_len:]
            if len(data) != header["nbytes"]:
                raise KVPayloadError(f"KV payload truncated: {len(data)} of {header['nbytes']} bytes")
            return cls(block_hash=header["hash"], namespace=header["ns"], dtype=header["dtype"],
                       shape=tuple(header["shape"]), layer=header["layer"], mac=header["mac"],
                       data=data)
        except (struct.error, KeyError, ValueError, TypeError, msgpack.UnpackException) as exc:
            raise KVPayloadError(f"malformed KV payload: {exc}") from None


BOUND_MASK = (1 << 62) - 1


def bound_digest(block) -> int:
    """What a sealed transport header names for an encoded payload, binding its bytes to the seal at no
    cost: the payload header's keyed digest (bytes 4..12), which covers the data's MAC, so a consumer that
    checks the payload (`from_bytes`, `verify`) checks every byte against the seal. Negative (at most -2),
    so no transport takes it for a checksum of the bytes; -2 for a block too short to be a payload."""
    view = memoryview(block).cast("B")
    if len(view) < PREFIX.size:
        return -2
    return -2 - (struct.unpack_from("<Q", view, 4)[0] & BOUND_MASK)


def wire_blocks(payloads: list[KVPayload]) -> list[tuple[int, bytes]]:
    """Payloads as they go on the wire (run on a KV thread): whole blocks under their hash, one layer's
    slices under their layer keys (`hashing.layer_key`)."""
    return [(p.block_hash if p.layer is None else layer_key(p.block_hash, p.layer), p.to_bytes()) for p in payloads]

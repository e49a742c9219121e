"""The KV payload checks bench_transfer.py's kv rows compare, in the same run: the keyed one payloads carry
now (an AES-GMAC of the bytes and a keyed header digest, mooncake/kv_mac.py; built by KVPayload itself) and
the unkeyed xxh3 one they had before (kv_payload version 2), rebuilt here as the baseline."""

import struct

import msgpack
import xxhash

from mooncake.hashing import checksum

KEYED, XXH3 = 1 << 62, 1 << 61  # key bits of the kv rows' blocks: checked with their MAC / as before it


def xxh3_payload(data) -> bytes:
    """A KV payload as it was before its keyed MAC (kv_payload version 2): the data's xxh3 checksum in a
    header hashed with xxh3; what the kv_xxh3 rows cost, beside the keyed kv rows, in the same run."""
    header = msgpack.packb({"v": 2, "hash": 1, "ns": b"m", "dtype": "uint8", "shape": [len(data)], "layer": None,
                            "checksum": checksum(data), "nbytes": len(data)})
    return b"".join((struct.pack("<IQ", len(header), xxhash.xxh3_64_intdigest(header)), header, data))


def xxh3_check(buf) -> None:
    view = memoryview(buf)
    length, digest = struct.unpack_from("<IQ", view)
    header_bytes = view[12:12 + length]
    assert xxhash.xxh3_64_intdigest(header_bytes) == digest
    assert checksum(view[12 + length:]) == msgpack.unpackb(header_bytes)["checksum"]

import pytest

from mooncake.errors import KVPayloadError
from mooncake.hashing import checksum
from mooncake.kv_payload import KVPayload


def payload(data=bytes(range(256)) * 4):
    return KVPayload(block_hash=7, namespace=b"m/bs4", dtype="float32", shape=(2, 2, 4, 1, 8), layer=None,
                     checksum=checksum(data), data=data)


def test_round_trip_through_bytes():
    p = payload()
    q = KVPayload.from_bytes(p.to_bytes())
    assert (q.block_hash, q.namespace, q.dtype, q.shape, q.layer, q.checksum) == \
           (p.block_hash, p.namespace, p.dtype, p.shape, p.layer, p.checksum)
    assert bytes(q.data) == p.data
    q.verify(namespace=b"m/bs4", dtype="float32", shape=(2, 2, 4, 1, 8))


def test_flipped_byte_is_detected():
    wire = bytearray(payload().to_bytes())
    wire[-10] ^= 0x01
    with pytest.raises(KVPayloadError, match="checksum"):
        KVPayload.from_bytes(bytes(wire)).verify()


@pytest.mark.parametrize("kwargs, match", [
    ({"namespace": b"other"}, "namespace"),
    ({"dtype": "bfloat16"}, "dtype"),
    ({"shape": (1, 2, 3)}, "shape"),
])
def test_metadata_mismatch_is_rejected(kwargs, match):
    with pytest.raises(KVPayloadError, match=match):
        payload().verify(**kwargs)


def test_truncated_and_garbage_frames_are_errors():
    wire = payload().to_bytes()
    with pytest.raises(KVPayloadError, match="truncated"):
        KVPayload.from_bytes(wire[:-1])
    with pytest.raises(KVPayloadError, match="malformed"):
        KVPayload.from_bytes(b"\x05\x00")

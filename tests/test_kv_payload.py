import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.errors import KVPayloadError
from mooncake.kv_payload import KVPayload


def payload(data=bytes(range(256)) * 4):
    return KVPayload.of(7, b"m/bs4", "float32", (2, 2, 4, 1, 8), None, data)


def test_round_trip_through_bytes():
    p = payload()
    q = KVPayload.from_bytes(p.to_bytes())
    assert (q.block_hash, q.namespace, q.dtype, q.shape, q.layer, q.mac) == \
           (p.block_hash, p.namespace, p.dtype, p.shape, p.layer, p.mac)
    assert bytes(q.data) == p.data
    q.verify(namespace=b"m/bs4", dtype="float32", shape=(2, 2, 4, 1, 8))


def test_flipped_byte_is_detected():
    wire = bytearray(payload().to_bytes())
    wire[-10] ^= 0x01
    with pytest.raises(KVPayloadError, match="fail their MAC"):
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


@settings(max_examples=300, deadline=None)
@given(position=st.integers(min_value=0), bit=st.integers(min_value=0, max_value=7))
def test_any_flipped_bit_anywhere_is_caught_by_the_consumer(position, bit):
    """Transports move a payload without hashing it (it carries its own check): a flip in the length, the
    header's hash, the header or the bytes must fail `from_bytes` or `verify`, never pass as good KV."""
    wire = bytearray(payload().to_bytes())
    wire[position % len(wire)] ^= 1 << bit
    with pytest.raises(KVPayloadError):
        KVPayload.from_bytes(bytes(wire)).verify(namespace=b"m/bs4", dtype="float32", shape=(2, 2, 4, 1, 8))


def test_a_flipped_header_field_is_caught_though_the_bytes_match():
    """The layer or the block hash are not covered by the bytes' MAC: the header's keyed digest is what
    catches a changed one."""
    wire = payload().to_bytes()
    at = wire.index(b"\xa4hash") + len(b"\xa4hash")  # msgpack: "hash" then the positive fixint 7
    changed = wire[:at] + bytes([8]) + wire[at + 1:]
    with pytest.raises(KVPayloadError, match="header fails its check"):
        KVPayload.from_bytes(changed)

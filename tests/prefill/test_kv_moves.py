"""How a prefill (whole, or one CPP stage) moves KV (mooncake/prefill/kv_moves.py): a prefix read from the
pool stops at the first block missing or corrupted and says which; a block decode refuses fails the push,
naming decode, the block and the request."""

import asyncio

import pytest

from mooncake.kv_payload import KVPayload
from mooncake.prefill.kv_moves import push_to_decode, read_prefix
from mooncake.transfer.contract import BlockResult, TransferError, TransferResult


def _payload(key: int) -> bytes:
    return KVPayload.of(key, b"m", "uint8", (4,), None, bytes([key % 256] * 4)).to_bytes()


class _Pool:
    def __init__(self, blocks: dict[int, bytes]):
        self.blocks = blocks

    async def get_blocks(self, keys):
        return {k: self.blocks[k] for k in keys if k in self.blocks}


@pytest.mark.parametrize("held, corrupt, kept, missing, bad", [
    ([1, 2, 3], None, 3, None, None),  # all served, in order
    ([1, 3], None, 1, 1, None),  # block 2 gone: the run stops there, though 3 is held
    ([1, 2, 3], 2, 1, 1, 2),  # block 2 served corrupted: named, for the caller to remove from the pool
])
def test_a_prefix_read_keeps_the_sound_leading_run_and_says_where_it_stopped(held, corrupt, kept, missing, bad):
    blocks = {k: _payload(k) for k in held}
    if corrupt is not None:
        data = bytearray(blocks[corrupt])
        data[12] ^= 0xFF  # in its header: the header's keyed digest no longer matches (its bytes are checked on import)
        blocks[corrupt] = bytes(data)
    read = asyncio.run(read_prefix(_Pool(blocks), [1, 2, 3]))
    assert [p.block_hash for p in read.payloads] == [1, 2, 3][:kept]
    assert (read.missing, read.bad_key) == (missing, bad)
    assert read.num_bytes == sum(len(blocks[k]) for k in [1, 2, 3][:kept + (bad is not None)])
    assert (read.error == "") == (missing is None)


class _Decode:
    async def send(self, peer, blocks, timeout_s, request_id, self_checked=False):
        assert self_checked  # a payload is checked once, by decode as it imports it
        return TransferResult(peer, request_id, [BlockResult(k, None if k != 0xB2 else "inbox full")
                                                 for k, _ in blocks], 10, 0.1)


def test_a_block_decode_does_not_take_fails_the_push_naming_decode_the_block_and_the_request():
    ok = asyncio.run(push_to_decode(_Decode(), "d0", "tcp://127.0.0.1:1", "r1", [(0xB1, b"x")], 1.0, "r1/0"))
    assert ok.ok
    with pytest.raises(TransferError, match=r"decode d0 at tcp://127.0.0.1:1 did not take block 0xb2 of request "
                                            r"r1 from stage 1: inbox full"):
        asyncio.run(push_to_decode(_Decode(), "d0", "tcp://127.0.0.1:1", "r1", [(0xB1, b"x"), (0xB2, b"y")], 1.0,
                                   "r1/0", " from stage 1"))

from mooncake.decode.inbox import KVInbox


def test_blocks_are_claimed_in_prefix_order_once_per_push():
    inbox = KVInbox(ttl_s=60)
    buf = bytearray(b"abc")
    inbox.put_block(1, memoryview(buf))
    buf[:] = b"zzz"  # the transport reuses its buffer: the inbox kept a copy
    inbox.put_block(2, b"def")
    inbox.put_block(2, b"def")  # a second request pushed the same shared block
    assert inbox.claim([1, 2, 3]) == [b"abc", b"def"]
    assert inbox.claim([2]) == [b"def"]  # the second push's copy
    assert inbox.claim([2]) == [] and len(inbox) == 0


def test_a_gap_stops_the_claim_and_unclaimed_blocks_expire():
    inbox = KVInbox(ttl_s=0.0)
    inbox.put_block(5, b"x")
    assert inbox.claim([4, 5]) == []
    assert inbox.expire() == 1 and len(inbox) == 0

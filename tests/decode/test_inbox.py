from mooncake.decode.inbox import KVInbox


def test_blocks_are_claimed_in_prefix_order_once_per_push():
    inbox = KVInbox(ttl_s=60)
    assert inbox.keeps_blocks  # transports hand it bytes it may hold: it keeps them without a copy
    first = memoryview(bytearray(b"abc"))
    inbox.put_block(1, first)
    inbox.put_block(2, b"def")
    inbox.put_block(2, b"def")  # a second request pushed the same shared block
    claimed = inbox.claim([1, 2, 3])
    assert claimed == [b"abc", b"def"] and claimed[0] is first
    assert inbox.claim([2]) == [b"def"]  # the second push's copy
    assert inbox.claim([2]) == [] and len(inbox) == 0


def test_a_gap_stops_the_claim_and_unclaimed_blocks_expire():
    inbox = KVInbox(ttl_s=0.0)
    inbox.put_block(5, b"x")
    assert inbox.claim([4, 5]) == []
    assert inbox.expire() == 1 and len(inbox) == 0

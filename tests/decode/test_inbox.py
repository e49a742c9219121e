from mooncake.decode.inbox import ORPHAN_TTL_S, KVInbox
from mooncake.hashing import layer_key


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


def test_the_inbox_is_bounded_in_bytes_and_refuses_past_it_with_a_clear_reason():
    inbox = KVInbox(ttl_s=60, max_bytes=10)
    assert inbox.put_block(1, b"123456") is None
    refusal = inbox.put_block(2, b"123456")
    assert refusal is not None and "full" in refusal and "instance.kv_inbox_bytes" in refusal
    assert inbox.put_block(1, b"123456") is None  # another copy of a held block costs no bytes
    assert inbox.claim([1]) == [b"123456"] and inbox.num_bytes == 6
    assert inbox.claim([1]) == [b"123456"] and inbox.num_bytes == 0
    assert inbox.put_block(2, b"123456") is None  # room again once claimed


def test_release_gives_back_a_cancelled_requests_copies_and_its_late_ones_expire_soon():
    inbox = KVInbox(ttl_s=60)
    for key in (1, 2):
        inbox.put_block(key, b"x" * 8)
    inbox.put_block(1, b"x" * 8)  # a second request shares block 1
    assert inbox.release([1, 2, 3]) == 1  # block 2 leaves; block 1 stays for the other request
    assert inbox.claim([1]) == [b"x" * 8] and len(inbox) == 0
    # Block 3 was still on its way when the request was cancelled: it lands uncounted, still claimable
    # (a migrated leg pushing the same block claims it) but gone after ORPHAN_TTL_S, not the inbox TTL.
    assert inbox.put_block(3, b"y" * 8) is None and len(inbox) == 1
    assert inbox.claim([3]) == [b"y" * 8] and len(inbox) == 0
    inbox.release([4])
    inbox.put_block(4, b"z" * 8)
    inbox._blocks[4][2] -= ORPHAN_TTL_S + 0.1  # as if ORPHAN_TTL_S had passed
    assert inbox.expire() == 1 and len(inbox) == 0 and inbox.num_bytes == 0
    # A counted copy (the next request's) of a released block keeps the inbox TTL.
    inbox.release([5])
    inbox.put_block(5, b"w" * 8)  # the late copy: uncounted
    inbox.put_block(5, b"w" * 8)  # a new push: counted
    inbox._blocks[5][2] -= ORPHAN_TTL_S + 0.1
    assert inbox.expire() == 0 and inbox.claim([5]) == [b"w" * 8] and len(inbox) == 0


def test_blocks_come_whole_or_by_layer_and_a_block_missing_a_layer_ends_the_claim():
    inbox = KVInbox(ttl_s=60)
    inbox.put_block(1, b"whole")  # a cached prefix block: sent whole even when layers stream
    for layer in range(3):
        inbox.put_block(layer_key(2, layer), f"2/L{layer}".encode())
    for layer in (0, 2):  # block 3's layer 1 has not arrived
        inbox.put_block(layer_key(3, layer), f"3/L{layer}".encode())
    assert inbox.claim_blocks([1, 2, 3], num_layers=3) == [b"whole", b"2/L0", b"2/L1", b"2/L2"]
    assert len(inbox) == 2  # block 3's two layers wait for the third (or expire)
    # A cancel gives back what is here by the keys it came by, and expects either way what is not here yet.
    assert inbox.release_blocks([3, 4, 5], num_layers=3) == 2 and len(inbox) == 0
    inbox.put_block(layer_key(4, 0), b"late")  # landed after the cancel: uncounted, so it expires soon
    inbox.put_block(5, b"late whole")
    assert inbox._blocks[layer_key(4, 0)][1] == 0 and inbox._blocks[5][1] == 0


def test_unclaimed_kv_waits_as_long_as_a_legs_prefill_may_take_unless_set():
    """A long prompt's first blocks arrive when its prefill starts and are claimed after its last chunk (84 s
    for 8k tokens on one CPU core): an inbox TTL under the prefill timeout dropped them, and decode computed
    the whole prompt again on its own core, stalling every stream there."""
    from mooncake.config import load_config
    from mooncake.decode.inbox import inbox_ttl_s

    default = load_config(None, {})
    assert inbox_ttl_s(default) > default.conductor.prefill_timeout_s
    assert inbox_ttl_s(load_config(None, {"conductor.prefill_timeout_s": 900.0})) > 900.0
    assert inbox_ttl_s(load_config(None, {"instance.kv_inbox_ttl_s": 10.0})) == 10.0  # set: as set

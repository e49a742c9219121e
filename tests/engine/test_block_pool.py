from mooncake.engine.block_pool import BlockPool


def test_allocate_until_empty_then_none_without_side_effects():
    pool = BlockPool(4)
    assert pool.allocate(3) is not None
    assert pool.allocate(2) is None
    assert pool.num_free == 1


def test_release_returns_blocks_and_ref_counts_are_shared():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.acquire(blocks)  # a second sequence shares them
    pool.release(blocks)
    assert pool.num_free == 2
    pool.release(blocks)
    assert pool.num_free == 4


def test_freed_block_stays_findable_until_reused():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.register(a, 111)
    pool.register(b, 222)
    pool.release([a, b])
    assert pool.match_prefix([111, 222, 333]) == [a, b]
    pool.acquire([a])  # reuse takes it off the free list
    assert pool.num_free == 1
    pool.release([a])
    # b was freed first (tail first), so it is evicted first; the prefix head survives longest.
    (fresh,) = pool.allocate(1)
    assert fresh == b
    assert pool.match_prefix([111, 222]) == [a]
    assert pool.match_prefix([222]) == []


def test_register_keeps_the_first_holder_of_a_hash():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.register(a, 5)
    assert not pool.register(b, 5)
    assert pool.match_prefix([5]) == [a]

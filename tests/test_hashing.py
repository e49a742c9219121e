from mooncake.hashing import checksum, hash_block, hash_blocks, make_namespace

NS = make_namespace("model-a", 4)


def test_only_full_blocks_are_hashed():
    assert len(hash_blocks(list(range(11)), 4, NS)) == 2
    assert hash_blocks([1, 2, 3], 4, NS) == []


def test_chained_hash_depends_on_whole_prefix():
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, NS)
    b = hash_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4, NS)
    assert a[1] != b[1]  # same second block, different first block
    assert a == hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, NS)  # a longer prompt shares the prefix keys
    assert a[1] == hash_block(a[0], [5, 6, 7, 8], NS)


def test_namespace_separates_models_and_block_sizes():
    tokens = list(range(8))
    assert hash_blocks(tokens, 4, NS) != hash_blocks(tokens, 4, make_namespace("model-b", 4))
    assert hash_blocks(tokens, 4, NS)[0] != hash_blocks(tokens, 8, make_namespace("model-a", 8))[0]


def test_hash_is_stable_across_processes_and_versions():
    # Fixed seed, u32 little-endian ids: nodes must agree on keys, so this value must never drift.
    assert hash_blocks([1, 2, 3, 4], 4, NS) == [0xED8309490389CD0E]
    assert checksum(b"mooncake") == checksum(bytearray(b"mooncake"))

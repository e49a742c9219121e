import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.hashing import (CHECKSUM_CHUNK_BYTES, PARALLEL_MIN_BYTES, checksum, hash_block, hash_blocks,
                              layer_key, make_namespace)

NS = make_namespace("model-a", 4, "float32")


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
    assert hash_blocks(tokens, 4, NS) != hash_blocks(tokens, 4, make_namespace("model-b", 4, "float32"))
    assert hash_blocks(tokens, 4, NS)[0] != hash_blocks(tokens, 8, make_namespace("model-a", 8, "float32"))[0]
    assert hash_blocks(tokens, 4, NS) != hash_blocks(tokens, 4, make_namespace("model-a", 4, "bfloat16"))


def test_hash_is_stable_across_processes_and_versions():
    # Fixed seed, u32 little-endian ids: nodes must agree on keys, so this value must never drift.
    # (The namespace gained the KV dtype in message version 2: keys written before are not reused.)
    assert hash_blocks([1, 2, 3, 4], 4, NS) == [0x3B2FFF107DFCDB84]
    assert checksum(b"mooncake") == checksum(bytearray(b"mooncake"))


def _two_level(data: bytes) -> int:
    """The checksum's definition, written out plainly: the reference the fast paths must match."""
    if len(data) <= CHECKSUM_CHUNK_BYTES:
        return xxhash.xxh3_64_intdigest(data)
    digests = [xxhash.xxh3_64_intdigest(data[i:i + CHECKSUM_CHUNK_BYTES])
               for i in range(0, len(data), CHECKSUM_CHUNK_BYTES)]
    return xxhash.xxh3_64_intdigest(b"".join(d.to_bytes(8, "little") for d in digests))


@pytest.mark.parametrize("size", [0, 7, CHECKSUM_CHUNK_BYTES, CHECKSUM_CHUNK_BYTES + 1, PARALLEL_MIN_BYTES - 1,
                                  PARALLEL_MIN_BYTES, 5 * CHECKSUM_CHUNK_BYTES + 3, 2 * PARALLEL_MIN_BYTES + 1])
def test_checksum_is_the_two_level_sum_on_one_thread_or_two(size):
    data = os.urandom(size)
    assert checksum(data) == checksum(np.frombuffer(data, dtype=np.uint8)) == _two_level(data)


def test_checksum_definition_is_pinned():
    # Blocks on SSD carry their checksum: a change here makes every stored block unreadable.
    data = bytes(range(256)) * (3 * CHECKSUM_CHUNK_BYTES // 256 + 1)
    assert checksum(data[:1000]) == 0xD33DD80B46F60E50
    assert checksum(data) == 0xB6ECFC3A849E53A3


def test_a_flipped_byte_in_any_chunk_changes_the_checksum():
    data = bytearray(os.urandom(PARALLEL_MIN_BYTES + CHECKSUM_CHUNK_BYTES))
    clean = checksum(data)
    for position in range(0, len(data), CHECKSUM_CHUNK_BYTES // 2):  # chunks hashed by either thread
        data[position] ^= 0x01
        assert checksum(data) != clean
        data[position] ^= 0x01
    assert checksum(data) == clean


def test_threads_share_the_checksum_worker():
    blocks = [os.urandom(PARALLEL_MIN_BYTES + i) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(checksum, blocks * 3)) == [_two_level(b) for b in blocks * 3]


def test_each_layer_of_a_block_has_its_own_key_the_same_on_every_node():
    hashes = hash_blocks(list(range(64)), 4, NS)
    keys = [layer_key(h, layer) for h in hashes for layer in range(80)]
    assert len(set(keys) | set(hashes)) == len(keys) + len(hashes)  # no two alike, none a block's own
    assert layer_key(hashes[0], 3) == layer_key(hashes[0], 3) and all(0 <= k < 1 << 64 for k in keys)



@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=70), block_size=st.integers(1, 16),
       root=st.integers(0, 2**64 - 1))
def test_the_batched_chain_is_hash_block_applied_block_by_block(tokens, block_size, root):
    """hash_blocks (one buffer, one call per block) is the definition hash_block spells out, for any
    tokens the vocabulary allows, any root (a salted chain's) and a trailing partial block."""
    parent, expected = root, []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start:start + block_size], NS)
        expected.append(parent)
    assert hash_blocks(tokens, block_size, NS, root) == expected

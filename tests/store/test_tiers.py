"""One contract suite over every storage tier, then what only the SSD tier promises."""

import os
import random

import pytest
import xxhash

from backends.storage import ssd
from backends.storage.dram import DramTier
from backends.storage.ssd import SsdTier
from mooncake.hashing import CHECKSUM_CHUNK_BYTES


@pytest.fixture(params=["dram", "ssd"])
def tier(request, tmp_path):
    if request.param == "dram":
        return DramTier(1 << 20)
    return SsdTier(tmp_path / "ssd", 1 << 20, fsync=False)


def blob(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def test_random_payloads_round_trip_bit_exact(tier):
    sizes = [1, 4096, 65536, 100_003]
    for key, size in enumerate(sizes):
        assert tier.put(key, blob(key, size))
    for key, size in enumerate(sizes):
        assert bytes(tier.get(key)) == blob(key, size)
        assert tier.size_of(key) == size and key in tier
    assert tier.used_bytes == sum(sizes)
    assert sorted(tier.keys()) == list(range(len(sizes)))


def test_full_tier_refuses_and_remove_makes_room(tier):
    assert tier.put(1, blob(1, 600_000))
    assert not tier.put(2, blob(2, 600_000))
    assert tier.get(2) is None and 2 not in tier
    assert tier.remove(1) and not tier.remove(1)
    assert tier.put(2, blob(2, 600_000))


def test_second_put_of_a_key_keeps_the_first(tier):
    assert tier.put(5, b"first")
    assert tier.put(5, b"other")
    assert bytes(tier.get(5)) == b"first"


def test_dram_free_extents_coalesce():
    tier = DramTier(300)
    for key in range(3):
        assert tier.put(key, bytes(100))
    tier.remove(1)
    tier.remove(0)
    assert tier.largest_free_extent() == 200
    assert tier.put(9, bytes(200))


def test_ssd_flipped_byte_is_never_served(tmp_path):
    tier = SsdTier(tmp_path, 1 << 20, fsync=False)
    tier.put(7, blob(7, 5000))
    path = next(tmp_path.glob("*.blk"))
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x10
    path.write_bytes(bytes(raw))
    assert tier.get(7) is None
    assert tier.num_corrupt_reads == 1 and 7 not in tier and tier.used_bytes == 0


def test_ssd_restart_recovers_whole_blocks_and_drops_the_rest(tmp_path):
    tier = SsdTier(tmp_path, 1 << 20)
    for key in range(4):
        tier.put(key, blob(key, 3000))
    files = sorted(tmp_path.glob("*.blk"))
    files[1].write_bytes(files[1].read_bytes()[:-7])  # torn write
    raw = bytearray(files[2].read_bytes())
    raw[40] ^= 0xFF  # corrupt data
    files[2].write_bytes(bytes(raw))
    (tmp_path / "0000000000000009.blk.tmp123").write_bytes(b"half a block")
    again = SsdTier(tmp_path, 1 << 20)
    assert sorted(again.keys()) == [0, 3]
    assert again.num_dropped_on_start == 3
    assert bytes(again.get(3)) == blob(3, 3000)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f.name for f in (files[0], files[3]))
    assert again.used_bytes == 6000 and os.listdir(tmp_path)


def test_ssd_drops_blocks_written_with_the_older_checksum(tmp_path):
    # Version 1 files summed a large block as one xxh3 digest; the checksum is now two-level above one chunk.
    data = blob(5, 3 * CHECKSUM_CHUNK_BYTES)
    header = ssd.HEADER.pack(ssd.MAGIC, 1, 5, len(data), xxhash.xxh3_64_intdigest(data))
    (tmp_path / f"{5:016x}{ssd.SUFFIX}").write_bytes(header + data)
    tier = SsdTier(tmp_path, 8 << 20)
    assert list(tier.keys()) == [] and tier.num_dropped_on_start == 1
    tier.put(6, data)
    again = SsdTier(tmp_path, 8 << 20)  # what this version writes, it reads back
    assert list(again.keys()) == [6] and bytes(again.get(6)) == data

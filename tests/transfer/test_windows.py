"""Write windows: a writer fills a lent range of the shared DRAM tier and the store adopts what verifies,
without copying; nothing is lost or leaked whatever the writer does."""

import os

import pytest

from mooncake.config import StoreConfig
from mooncake.errors import CapacityError
from mooncake.hashing import checksum
from mooncake.store.store import KVStore
from mooncake.transfer.windows import UnknownWindow, WriteWindows

MiB = 1 << 20


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def store():
    clock = Clock()
    store = KVStore(StoreConfig(dram_bytes=16 * MiB), clock=clock, shared_dram=True)
    store.clock_ = clock
    yield store
    store.close()


def write(store, offset, data):
    store.reserved_view(offset, len(data))[:] = data
    return checksum(data)


def test_blocks_written_in_place_are_adopted_where_they_lie(store):
    windows = WriteWindows(store)
    window_id, offset, size = windows.open(want=64 * MiB, need=MiB // 4)
    assert size == 16 * MiB // WriteWindows.MAX_SHARE  # capped at a share of DRAM
    a, b = os.urandom(MiB // 4), os.urandom(MiB // 8)
    blocks = [(1, offset, len(a), write(store, offset, a)),
              (2, offset + len(a), len(b), write(store, offset + len(a), b))]
    assert windows.commit(window_id, blocks) == [None, None]
    assert windows.lent_bytes() == size - len(a) - len(b)
    assert bytes(store.get(1).data) == a and bytes(store.get(2).data) == b
    assert store.dram_location(1)[1] == offset  # the very bytes the writer wrote, not a copy
    assert store._sums == {1: checksum(a), 2: checksum(b)}
    assert [e.kind for e in store.drain_events()] == ["add", "add"]
    windows.close(window_id)
    assert store.tiers[0].used_bytes == len(a) + len(b)  # the rest of the window went back
    big_id, _, big = windows.open(want=64 * MiB, need=2 * MiB)
    assert big == 2 * MiB  # one put may need more than the share
    windows.close(big_id)


def test_a_corrupt_block_a_held_key_and_a_stray_range_lose_nothing(store):
    store.put(5, b"already here")
    windows = WriteWindows(store)
    window_id, offset, size = windows.open(want=MiB, need=MiB)
    good, bad, dup = os.urandom(1000), os.urandom(1000), b"already here"
    sums = [write(store, offset, good), write(store, offset + 1000, bad), write(store, offset + 2000, dup)]
    store.reserved_view(offset + 1000, 1)[0] ^= 0xFF  # flipped after checksumming
    errors = windows.commit(window_id, [(1, offset, 1000, sums[0]), (2, offset + 1000, 1000, sums[1]),
                                        (5, offset + 2000, len(dup), sums[2]),
                                        (6, offset, 10, 0),  # overlaps block 1
                                        (7, offset + size, 10, 0)])  # beyond the window
    assert errors[0] is None and "checksum" in errors[1] and errors[2] is None
    assert "outside" in errors[3] and "outside" in errors[4]
    assert store.exists(1) == "dram" and store.exists(2) is None and store.exists(6) is None
    assert bytes(store.get(5).data) == b"already here"
    windows.close(window_id)
    assert store.tiers[0].used_bytes == 1000 + len(b"already here")


def test_an_abandoned_window_expires_and_its_bytes_come_back(store):
    windows = WriteWindows(store, ttl_s=30.0, clock=store.clock_)
    window_id, offset, size = windows.open(want=MiB, need=MiB)
    assert store.tiers[0].used_bytes == size
    store.clock_.now = 31.0
    windows.expire()  # the cache role calls this periodically; every open and commit does too
    assert len(windows) == 0 and store.tiers[0].used_bytes == 0
    with pytest.raises(UnknownWindow):
        windows.commit(window_id, [(1, offset, 10, 0)])


def test_a_window_makes_room_by_evicting_but_is_never_evicted_itself(store):
    for key in range(14):
        store.put(key, os.urandom(MiB))
    lease = store.get(0)  # leased: stays
    windows = WriteWindows(store)
    window_id, offset, size = windows.open(want=4 * MiB, need=4 * MiB)
    # 2 MiB were free at the end; first fit needs 4 contiguous: the oldest unleased blocks 1-4 went
    assert size == 4 * MiB and [k for k in range(14) if store.exists(k)] == [0, *range(5, 14)]
    store.release(lease.lease_id)
    for key in range(100, 112):  # fills DRAM again by evicting blocks, never the window
        store.put(key, os.urandom(MiB))
    data = os.urandom(MiB)
    assert windows.commit(window_id, [(200, offset, MiB, write(store, offset, data))]) == [None]
    assert bytes(store.get(200).data) == data
    leases = [store.get(k) for k in range(100, 112) if store.exists(k)]  # pin every block (200 is, above)
    assert store.tiers[0].used_bytes == 16 * MiB
    with pytest.raises(CapacityError):  # only the window's free part is left, and it is not the store's
        store.put(300, os.urandom(MiB))
    for lease in leases:
        store.release(lease.lease_id)


def test_a_store_without_shared_dram_lends_no_window():
    store = KVStore(StoreConfig(dram_bytes=4 * MiB))
    assert WriteWindows(store).open(want=MiB, need=MiB) is None
    store.close()


def test_random_writers_puts_evictions_and_expiry_keep_every_byte_accounted_for(store):
    """Three writers fill windows (some blocks corrupt, some keys repeated) among plain puts, reads with
    leases, closes and expiries. After every step the arena's free ranges, the blocks and the windows'
    unused ranges tile DRAM exactly, and every block held verifies."""
    import random
    rng = random.Random(7)
    dram = store.tiers[0]
    windows = WriteWindows(store, ttl_s=5.0, clock=store.clock_)
    open_windows: dict[int, list[int]] = {}  # writer -> [window id, cursor, end]
    leases = []
    plain: dict[int, int] = {}  # checksums of blocks put the usual way (the store keeps none for them)

    def check():
        spans = list(dram._arena._free) + list(dram._blocks.values())
        for w in windows._windows.values():
            taken = sorted(w.taken)
            cursor = w.offset
            for offset, size in taken + [(w.offset + w.size, 0)]:
                if offset > cursor:
                    spans.append((cursor, offset - cursor))
                cursor = max(cursor, offset + size)
        spans = sorted(s for s in spans if s[1] > 0)
        cursor = 0
        for offset, size in spans:
            assert offset == cursor, f"gap or overlap at {offset} (expected {cursor})"
            cursor = offset + size
        assert cursor == dram.capacity_bytes
        for key in list(dram._blocks):
            assert checksum(dram.get(key)) == store._sums.get(key, plain.get(key))

    for step in range(400):
        op = rng.random()
        writer = rng.randrange(3)
        if op < 0.45:
            size = rng.choice([1000, 50_000, 300_000])
            state = open_windows.get(writer)  # [window id, cursor, end, usable until], as the shm sender
            if state is None or state[1] + size > state[2] or store.clock_.now >= state[3]:
                if state is not None:
                    windows.close(state[0])
                opened = windows.open(want=MiB, need=size)
                if opened is None:
                    continue
                state = open_windows[writer] = [opened[0], opened[1], opened[1] + opened[2], 0.0]
            key = rng.randrange(60)
            data = rng.randbytes(size)
            digest = write(store, state[1], data)
            if rng.random() < 0.1:
                store.reserved_view(state[1], 1)[0] ^= 1
            state[3] = store.clock_.now + windows.ttl_s - 2.0
            windows.commit(state[0], [(key, state[1], size, digest)])
            state[1] += size
        elif op < 0.65:
            key, data = rng.randrange(60, 120), rng.randbytes(rng.choice([1000, 200_000]))
            held = store.exists(key) is not None
            try:
                store.put(key, data)
                if not held:
                    plain[key] = checksum(data)
            except CapacityError:
                pass
        elif op < 0.8:
            lease = store.get(rng.randrange(120))
            if lease is not None:
                leases.append(lease)
        elif op < 0.9 and leases:
            store.release(leases.pop(rng.randrange(len(leases))).lease_id)
        elif op < 0.95 and open_windows:
            windows.close(open_windows.pop(rng.choice(list(open_windows)))[0])
        else:
            store.clock_.now += rng.choice([1.0, 6.0])
        check()
    windows.close_all()
    check()
    assert dram.used_bytes == sum(n for _, n in dram._blocks.values())


def test_a_range_overlaps_exactly_when_it_meets_one_already_taken():
    import random

    from mooncake.transfer.windows import _Window
    rng = random.Random(5)
    window = _Window(offset=0, size=4096, expires=0.0)
    for _ in range(2000):
        offset, size = rng.randrange(4096), rng.randrange(1, 64)
        brute = any(offset < o + n and o < offset + size for o, n in window.taken)
        assert window.overlaps(offset, size) == brute, (offset, size)
        if not brute and rng.random() < 0.5:
            window.take(offset, size)
    assert window.taken == sorted(window.taken) and len(window.taken) > 50
    assert window.taken_bytes == sum(n for _, n in window.taken)

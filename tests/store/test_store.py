import pytest

from mooncake.config import StoreConfig
from mooncake.errors import CapacityError, ConfigError
from mooncake.store.store import KVStore


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make(tmp_path=None, dram=300, ssd=0, **kw):
    cfg = StoreConfig(dram_bytes=dram, ssd_dir=str(tmp_path / "ssd") if ssd else "", ssd_bytes=ssd,
                      ssd_fsync=False, **kw)
    clock = FakeClock()
    return KVStore(cfg, clock=clock), clock


def test_put_get_exists_and_second_put_is_a_noop():
    store, _ = make()
    store.put(1, b"a" * 100)
    store.put(1, b"b" * 100)
    lease = store.get(1)
    assert bytes(lease.data) == b"a" * 100 and lease.tier == "dram"
    assert store.exists(1) == "dram" and store.exists(2) is None
    assert store.get(2) is None and store.metrics.misses == 1
    assert [e.kind for e in store.drain_events()] == ["add"]


def test_lru_eviction_announces_evictions():
    store, _ = make()
    for key in range(3):
        store.put(key, bytes(100))
    store.release(store.get(0).lease_id)  # 0 is now the most recently used
    store.put(3, bytes(100))
    assert store.exists(1) is None and store.exists(0) == "dram"
    events = store.drain_events()
    assert ("evict", 1) in [(e.kind, e.key) for e in events]
    assert store.metrics.evictions["dram"] == 1


def test_leased_blocks_are_never_evicted_and_full_store_is_a_capacity_error():
    store, clock = make()
    leases = [store.get(k) for k in range(3) if store.put(k, bytes(100)) is None]
    with pytest.raises(CapacityError, match="store full"):
        store.put(9, bytes(100))
    assert all(store.exists(k) for k in range(3))
    assert store.remove(0) and store.exists(0) == "dram"  # leased: goes when released
    store.release(leases[0].lease_id)
    store.put(9, bytes(100))
    assert store.exists(0) is None and store.exists(9) == "dram"


def test_a_block_removed_while_leased_goes_when_read_and_a_put_meanwhile_replaces_it():
    """A reader found the block corrupted and had it removed while its own read still leased it; the
    copy it recomputed and put meanwhile takes the bad one's place once the lease ends."""
    store, clock = make(lease_s=2.0)
    store.put(1, b"bad!" * 25)
    lease = store.get(1)
    assert store.remove(1) and bytes(store.get(1).data) == b"bad!" * 25  # still served while leased
    store.put(1, b"good" * 25, checksum=5)  # held: kept for later, not stored now
    store.release(lease.lease_id)
    assert store.exists(1) == "dram"  # one lease (the second get's) still holds the bad copy
    clock.now = 3.0
    assert bytes(store.get(1).data) == b"good" * 25 and store._sums[1] == 5
    assert [e.kind for e in store.drain_events()] == ["add", "evict", "add"]
    assert store.remove(1) is True and store.remove(9) is False
    clock.now = 6.0
    assert store.get(1) is None  # removed with nothing put meanwhile: gone


def test_leases_expire():
    store, clock = make(lease_s=2.0)
    for k in range(3):
        store.put(k, bytes(100))
        store.get(k)
    clock.now = 2.5
    store.put(9, bytes(100))  # expired leases no longer pin anything
    assert store.exists(9) == "dram"


def test_eviction_demotes_to_ssd_and_a_hit_promotes(tmp_path):
    store, _ = make(tmp_path, dram=200, ssd=1000)
    for key in range(3):
        store.put(key, bytes([key]) * 100)
    assert store.exists(0) == "ssd" and store.metrics.demotions == 1
    lease = store.get(0)
    assert lease.tier == "dram" and bytes(lease.data) == bytes([0]) * 100
    assert store.metrics.promotions == 1 and store.metrics.hits["ssd"] == 1
    assert store.exists(1) == "ssd"  # made room for the promoted block
    assert store.match_prefix([0, 1, 2, 5]) == ["dram", "ssd", "dram"]


def test_blocks_on_ssd_survive_a_store_restart(tmp_path):
    store, _ = make(tmp_path, dram=100, ssd=1000)
    store.put(1, b"x" * 100)
    store.put(2, b"y" * 100)  # demotes 1
    store.close()
    again, _ = make(tmp_path, dram=100, ssd=1000)
    assert again.exists(1) == "ssd" and bytes(again.get(1).data) == b"x" * 100


def test_a_block_larger_than_every_tier_is_refused_alone():
    store, _ = make()
    store.put(1, bytes(100))
    with pytest.raises(CapacityError, match="larger than a tier"):
        store.put(2, bytes(1000))
    store.put(3, bytes(100))
    assert [store.exists(k) for k in (1, 2, 3)] == ["dram", None, "dram"]


@pytest.mark.parametrize("kwargs, key", [({"dram_bytes": 0}, "store.dram_bytes"),
                                         ({"eviction": "fifo"}, "store.eviction"),
                                         ({"ssd_dir": "/tmp/x"}, "store.ssd_bytes")])
def test_bad_store_config_names_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        StoreConfig(**kwargs)

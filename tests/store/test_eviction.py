import pytest

from mooncake.errors import BackendError
from mooncake.store.eviction import LengthAwarePolicy, LFUPolicy, LRUPolicy, make_policy


def test_lru_evicts_least_recently_touched():
    p = LRUPolicy()
    for k in "abc":
        p.touch(k)
    p.touch("a")
    assert p.victim() == "b"
    assert p.victim(can_evict=lambda k: k != "b") == "c"


def test_lfu_evicts_fewest_hits_then_oldest():
    p = LFUPolicy()
    for k in "abc":
        p.touch(k)
    p.touch("a")
    p.touch("b")
    assert p.victim() == "c"
    p.remove("c")
    p.touch("a")
    assert p.victim() == "b"


def test_length_aware_evicts_late_blocks_first():
    p = LengthAwarePolicy()
    p.touch("head", position=0)
    p.touch("tail", position=9)
    p.touch("mid", position=4)
    p.touch("tail", position=9)  # recently used but still late in its prompt
    assert p.victim() == "tail"
    p.remove("tail")
    assert p.victim() == "mid"


@pytest.mark.parametrize("name", ["lru", "lfu", "length-aware"])
def test_victim_skips_pinned_and_none_when_all_pinned(name):
    p = make_policy(name)
    for k in range(5):
        p.touch(k, position=k)
    assert p.victim(can_evict=lambda k: False) is None
    v = p.victim(can_evict=lambda k: k != 4)
    assert v is not None and v != 4
    assert len(p) == 5  # victim() only names; the caller removes
    for k in range(5):
        p.remove(k)
    assert p.victim() is None and len(p) == 0


def test_unknown_policy_is_a_config_error():
    with pytest.raises(BackendError, match="unknown eviction backend 'mru'"):
        make_policy("mru")

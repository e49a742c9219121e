import pytest

from mooncake.conductor.estimators import BandwidthEstimator, DecodeStepModel, PrefillTimeModel
from mooncake.conductor.policies import Estimators, make_placement_policy
from mooncake.conductor.prefix_index import PrefixIndex
from mooncake.conductor.view import ClusterView, DecodeLoad, DecodeView, PrefillView, RequestView
from mooncake.errors import BackendError

BLOCK = 512
BLOCK_BYTES = 100 << 20  # 100 MiB of KV per block
HASHES = tuple(range(100, 110))  # a 10-block prompt


def estimators(bandwidth=1e9):
    # 1 ms per uncached token, nothing quadratic: a cold 5120-token prompt takes 5.12 s.
    return Estimators(PrefillTimeModel(0.01, 0.001, 0.0), DecodeStepModel(0.01, 0.002, 0.0),
                      BandwidthEstimator(bandwidth))


def cluster(prefills, decodes=None):
    return ClusterView(prefills=prefills, decodes=decodes or [DecodeView("d0")], block_size=BLOCK,
                       block_bytes=BLOCK_BYTES)


REQUEST = RequestView("r1", num_tokens=10 * BLOCK, block_hashes=HASHES)


def test_cache_rich_but_queued_loses_to_idle_but_cold_when_the_fetch_is_cheaper():
    index = PrefixIndex()
    index.add("p0", HASHES)
    policy = make_placement_policy("kvcache-centric", index, estimators(bandwidth=1e9))
    busy, idle = PrefillView("p0", queued_prefill_s=20.0), PrefillView("p1")
    placement = policy.place(REQUEST, cluster([busy, idle]), now=0.0)
    # p1 fetches all 10 blocks from p0: 1000 MiB at 1 GB/s ~ 1.05 s, versus 20 s of queue on p0.
    assert placement.prefill_id == "p1" and placement.fetch_from == "p0" and placement.reuse_blocks == 10
    assert placement.transfer_s == pytest.approx(10 * BLOCK_BYTES / 1e9)
    # with a short queue, staying with the cache wins
    busy.queued_prefill_s = 0.5
    placement = policy.place(REQUEST, cluster([busy, idle]), now=0.0)
    assert placement.prefill_id == "p0" and placement.fetch_from is None and placement.transfer_s == 0.0


def test_idle_and_cold_wins_when_the_network_is_slow():
    index = PrefixIndex()
    index.add("p0", HASHES)
    policy = make_placement_policy("kvcache-centric", index, estimators(bandwidth=1e8))  # 10 s to fetch
    placement = policy.place(REQUEST, cluster([PrefillView("p0", queued_prefill_s=8.0), PrefillView("p1")]), 0)
    assert placement.prefill_id == "p0"  # 8 s queue beats 10.5 s of transfer


def test_transfer_branch_versus_local_follows_the_balancing_threshold():
    index = PrefixIndex()
    index.add("cache-node", HASHES)  # the pool holds all 10 blocks
    index.add("p1", HASHES[:6])  # p1 holds 6 locally
    policy = make_placement_policy("kvcache-centric", index, estimators(), balancing_threshold=2.0)
    placement = policy.place(REQUEST, cluster([PrefillView("p1")]), 0)
    assert placement.reuse_blocks == 6 and placement.fetch_from is None  # 10/6 <= 2: keep local
    index.remove("p1", HASHES[2:6])  # now 10/2 = 5 > 2: fetch the difference
    placement = policy.place(REQUEST, cluster([PrefillView("p1")]), 0)
    assert placement.reuse_blocks == 10 and placement.fetch_from == "cache-node"
    assert placement.transfer_s == pytest.approx(8 * BLOCK_BYTES / 1e9)


def test_only_fetchable_holders_are_sources():
    """The live conductor's view names the cache nodes as the only sources: a busy prefill instance's
    cache is never planned as a fetch (no data path serves it), the pool's copy is. The replica a fetch
    leaves is made and reported by the instance itself (tests/e2e/test_placement.py)."""
    index = PrefixIndex()
    index.add("p0", HASHES)
    policy = make_placement_policy("kvcache-centric", index, estimators())
    prefills = [PrefillView("p0", queued_prefill_s=30), PrefillView("p1")]
    live = ClusterView(prefills, [DecodeView("d0")], BLOCK, BLOCK_BYTES, fetchable=frozenset({"cache-0"}))
    placement = policy.place(REQUEST, live, 0)
    assert placement.prefill_id == "p1" and placement.fetch_from is None and placement.reuse_blocks == 0
    index.add("cache-0", HASHES)
    placement = policy.place(REQUEST, live, 0)
    assert placement.prefill_id == "p1" and placement.fetch_from == "cache-0" and placement.reuse_blocks == 10
    # The simulator's view (every holder serves): p0 itself is a source.
    index.remove("cache-0", HASHES)
    assert policy.place(REQUEST, cluster(prefills), 0).fetch_from == "p0"


def test_local_cache_aware_never_fetches():
    index = PrefixIndex()
    index.add("p0", HASHES)
    policy = make_placement_policy("local-cache-aware", index, estimators())
    placement = policy.place(REQUEST, cluster([PrefillView("p0", queued_prefill_s=20.0), PrefillView("p1")]), 0)
    assert placement.prefill_id == "p1" and placement.reuse_blocks == 0 and placement.fetch_from is None


def test_baselines():
    index = PrefixIndex()
    prefills = [PrefillView("p0", queued_prefill_s=3), PrefillView("p1", queued_prefill_s=1), PrefillView("p2")]
    least = make_placement_policy("least-loaded", index, estimators())
    assert least.place(REQUEST, cluster(prefills), 0).prefill_id == "p2"
    rr = make_placement_policy("round-robin", index, estimators())
    assert [rr.place(REQUEST, cluster(prefills), 0).prefill_id for _ in range(4)] == ["p0", "p1", "p2", "p0"]
    def random_picks():
        return [make_placement_policy("random", index, estimators(), seed=s).place(REQUEST, cluster(prefills), 0)
                .prefill_id for s in range(20)]
    picks = random_picks()
    assert len(set(picks)) > 1 and picks == random_picks()  # spread out, and deterministic per seed


def test_decode_goes_to_the_lowest_predicted_tbt():
    index = PrefixIndex()
    busy = DecodeView("d0", [DecodeLoad(0, 100, 1000)] * 8)
    light = DecodeView("d1", [DecodeLoad(0, 100, 1000)] * 2)
    policy = make_placement_policy("kvcache-centric", index, estimators())
    placement = policy.place(REQUEST, cluster([PrefillView("p0")], [busy, light]), now=1.0)
    assert placement.decode_id == "d1" and placement.tbt_s == pytest.approx(0.01 + 0.002 * 3)


def test_unknown_policy_and_empty_cluster():
    with pytest.raises(BackendError, match="unknown placement backend .best."):
        make_placement_policy("best", PrefixIndex(), estimators())
    policy = make_placement_policy("random", PrefixIndex(), estimators())
    assert policy.place(REQUEST, ClusterView([], [], BLOCK, BLOCK_BYTES), 0) is None


def test_decode_goes_where_tbt_is_lowest_counting_requests_still_in_prefill():
    policy = make_placement_policy("kvcache-centric", PrefixIndex(), estimators())
    # d0 holds a request that reaches decode in 2 s (still in prefill now); d1 holds nothing.
    d0 = DecodeView("d0", [DecodeLoad(start_s=2.0, finish_s=60.0, context_tokens=4000)])
    d1 = DecodeView("d1")
    placement = policy.place(REQUEST, cluster([PrefillView("p0")], [d0, d1]), now=0.0)
    assert placement.ttft_s > 2.0  # this request reaches decode after d0's does
    assert placement.decode_id == "d1"
    # once d0's request has finished by the time this one arrives, the tie goes to the lower id again
    d0.requests = [DecodeLoad(start_s=0.0, finish_s=1.0, context_tokens=4000)]
    assert policy.place(REQUEST, cluster([PrefillView("p0")], [d0, d1]), now=0.0).decode_id == "d0"


def test_a_cpp_group_is_judged_by_its_pipelines_time():
    """A group of 4 run as a pipeline (CPP) prefills a long prompt about 4x faster than one instance: it
    wins over an idle instance though 2 s are queued on it; a prompt under the threshold passes through
    as one chunk, gains nothing, and goes to the idle instance."""
    from mooncake.conductor.cpp import CppSettings
    policy = make_placement_policy("kvcache-centric", PrefixIndex(), estimators(bandwidth=1e11))
    policy.cpp = CppSettings(stages=4, threshold_tokens=1024, chunk_tokens=256)
    single, group = PrefillView("p0"), PrefillView("g0", queued_prefill_s=2.0, stages=4)
    placement = policy.place(REQUEST, cluster([single, group]), now=0.0)  # 5120 tokens: 5.13 s alone
    assert placement.prefill_id == "g0"
    assert 2.0 + 5.12 / 4 < placement.ttft_s < 2.0 + 5.12 / 3
    short = RequestView("r2", num_tokens=1000, block_hashes=(7, 8))
    assert policy.place(short, cluster([single, group]), now=0.0).prefill_id == "p0"
    policy.cpp = None  # a conductor without CPP judges a group as one instance
    assert policy.place(REQUEST, cluster([single, group]), now=0.0).prefill_id == "p0"


def test_a_live_cpp_group_reads_a_pool_prefix_and_names_its_stages():
    """A live group (member_ids) reuses a prefix the pool holds (each stage reads it there): with 4 of 10
    blocks in the pool it reads them and pipelines the other 6; with 9 the rest is one short chunk, the
    pipeline gains nothing, and one instance wins; cold, the group wins. The placement names the stages in
    order, the last as the prefill instance."""
    from mooncake.conductor.cpp import CppSettings
    index = PrefixIndex()
    policy = make_placement_policy("kvcache-centric", index, estimators(bandwidth=1e11))
    policy.cpp = CppSettings(stages=2, threshold_tokens=1024, chunk_tokens=256)
    views = [PrefillView("p0"), PrefillView("p1"), PrefillView("p0+p1", stages=2, member_ids=("p0", "p1"))]
    index.add("cache-0", HASHES[:4])
    placement = policy.place(REQUEST, cluster(views), now=0.0)
    assert placement.stage_ids == ("p0", "p1") and placement.prefill_id == "p1"
    assert placement.reuse_blocks == 4 and placement.fetch_from == "cache-0"
    assert placement.transfer_s == pytest.approx(4 * BLOCK_BYTES / 1e11)
    index.add("cache-0", HASHES[4:9])
    placement = policy.place(REQUEST, cluster(views), now=0.0)
    assert placement.stage_ids == () and placement.reuse_blocks == 9 and placement.prefill_id in ("p0", "p1")
    cold = RequestView("r3", num_tokens=10 * BLOCK, block_hashes=tuple(range(300, 310)))
    placement = policy.place(cold, cluster(views), now=0.0)
    assert placement.stage_ids == ("p0", "p1") and placement.prefill_id == "p1" and placement.reuse_blocks == 0


def test_the_cluster_view_offers_a_group_of_the_least_loaded_instances():
    from mooncake import messages as msgs
    from mooncake.conductor.decide import cluster_view
    from mooncake.conductor.instances import InstanceRegistry
    registry = InstanceRegistry(heartbeat_timeout_s=1e9)
    for name in ("p0", "p1", "p2"):
        registry.register(msgs.Register(instance_id=name, role="prefill", model_id="x", block_size=16,
                                        kv_dtype="float32"), now=0.0)
    assert len(cluster_view(registry, {}, 16, 1024, frozenset(), 0.0).prefills) == 3
    view = cluster_view(registry, {}, 16, 1024, frozenset(), 0.0, group_stages=2)
    group = view.prefills[-1]
    assert group.member_ids == ("p0", "p1") and group.stages == 2 and group.instance_id == "p0+p1"
    assert len(cluster_view(registry, {}, 16, 1024, frozenset(), 0.0, group_stages=4).prefills) == 3  # too few

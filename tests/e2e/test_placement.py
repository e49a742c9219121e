"""Placement end to end on 2 prefill + 2 decode instances: Algorithm 1 sends a shared prefix where it is
cached; when that instance dies the prefix comes from the cache pool and stays as a local replica;
concurrent requests spread over the decode instances."""

import re
import signal
import threading
import time
import uuid

import pytest

from tests.e2e.conftest import indexed, make_cluster, metrics, post, wait_for

pytestmark = pytest.mark.slow  # make test skips it; make test-all and .ci/run run it

BLOCK = 16


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    with make_cluster(tmp_path_factory, "tcp", num_prefill=2, num_decode=2) as c:
        yield c


def computed(m, instance):
    return m.get(f'mooncake_prefill_computed_tokens_total{{instance="{instance}"}}', 0.0)


def fetched(m, instance):
    return m.get(f'mooncake_kv_fetch_bytes_total{{instance="{instance}"}}', 0.0)


def complete(cluster, prompt, **extra):
    status, reply = post(cluster.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2,
                                                           "temperature": 0, **extra})
    assert status == 200, reply
    return reply


def test_a_shared_prefix_goes_where_it_is_cached_then_comes_from_the_pool(cluster):
    prefix = f"{uuid.uuid4().hex}: a long shared preamble that fills ten blocks or so, " * 3
    cached = len(prefix.encode()) // BLOCK * BLOCK
    m0 = metrics(cluster.url)
    known = {p: indexed(cluster.url, p) for p in ("prefill-0", "prefill-1")}
    complete(cluster, prefix + "first")
    m1 = metrics(cluster.url)
    (holder,) = [p for p in ("prefill-0", "prefill-1") if computed(m1, p) > computed(m0, p)]
    other = "prefill-1" if holder == "prefill-0" else "prefill-0"
    wait_for(lambda: indexed(cluster.url, holder) >= known[holder] + cached // BLOCK, 10,
             "the holder's new blocks in the conductor's index (its heartbeats)")

    second = complete(cluster, prefix + "second")
    m2 = metrics(cluster.url)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert computed(m2, holder) - computed(m1, holder) == second["usage"]["prompt_tokens"] - cached
    assert computed(m2, other) == computed(m1, other) and fetched(m2, holder) == fetched(m1, holder)

    cluster.kill(holder, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while holder in cluster.health().get("prefill", [holder]) and time.monotonic() < deadline:
        time.sleep(0.1)
    third = complete(cluster, prefix + "third")
    m3 = metrics(cluster.url)
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == cached  # read from the cache node
    assert fetched(m3, other) > fetched(m2, other)
    assert computed(m3, other) - computed(m2, other) == third["usage"]["prompt_tokens"] - cached

    # The fetch left a replica (hot-spot migration): `other` reported the blocks as its own, so the next
    # request reuses them locally and reads nothing from the pool.
    wait_for(lambda: indexed(cluster.url, other) >= known[other] + cached // BLOCK, 10,
             "the replica's blocks in the conductor's index")
    fourth = complete(cluster, prefix + "fourth")
    m4 = metrics(cluster.url)
    assert fourth["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert fetched(m4, other) == fetched(m3, other)

    cluster.spawn(cluster.process(holder))
    cluster.wait_ready(120)


def test_a_restarted_conductor_refills_its_index_and_places_a_prefix_where_it_is_cached(cluster):
    prefix = f"{uuid.uuid4().hex}: a preamble the restarted conductor must remember, " * 3
    cached = len(prefix.encode()) // BLOCK * BLOCK
    # Put the prefix on prefill-1 (an idle cluster would pick prefill-0, the first id, for a new prompt).
    cluster.kill("prefill-0", signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while "prefill-0" in cluster.health().get("prefill", ["prefill-0"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        complete(cluster, prefix + "first")
    finally:
        cluster.kill("prefill-0", signal.SIGCONT)
    cluster.wait_ready(60)

    def snapshots() -> int:  # NOTE: prefill-1's own, not just as many hashes (the pool's alone hold the prefix)
        return len(re.findall(r"prefill-1: \d+ cached blocks indexed from its snapshot",
                              (cluster.workdir / "conductor.log").read_text()))  # appended to across restarts
    before = snapshots()
    cluster.kill("conductor", signal.SIGKILL)
    cluster.spawn(cluster.process("conductor"))
    cluster.wait_ready(120)
    deadline = time.monotonic() + 10  # the instances' and cache nodes' snapshots refill the index
    while metrics(cluster.url).get("mooncake_prefix_index_blocks", 0) < 2 * (cached // BLOCK) or \
            snapshots() <= before:
        assert time.monotonic() < deadline, "the restarted conductor's index was not refilled"
        time.sleep(0.1)
    m0 = metrics(cluster.url)
    second = complete(cluster, prefix + "second")
    m1 = metrics(cluster.url)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert computed(m1, "prefill-1") - computed(m0, "prefill-1") == second["usage"]["prompt_tokens"] - cached
    assert computed(m1, "prefill-0") == computed(m0, "prefill-0")  # not a cold instance fetching it
    assert fetched(m1, "prefill-1") == fetched(m0, "prefill-1")


def test_concurrent_requests_spread_over_the_decode_instances(cluster):
    seen = {"decode-0": 0.0, "decode-1": 0.0}
    done = threading.Event()

    def watch():
        while not done.is_set():
            m = metrics(cluster.url)
            for d in seen:
                seen[d] = max(seen[d], m.get(f'mooncake_requests_in_flight{{instance="{d}"}}', 0.0))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    workers = [threading.Thread(target=complete, args=(cluster, f"request {i}: tell me more"),
                                kwargs={"max_tokens": 400, "ignore_eos": True}) for i in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    done.set()
    watcher.join(5)
    assert seen["decode-0"] >= 1 and seen["decode-1"] >= 1, seen

"""The conductor as the front door's placement service (DESIGN section 13), over its real control socket,
with stand-ins for a prefill, a decode and an API process: a leg is placed with the API's report address,
handed off to decode, freed everywhere when it ends; a leg a restarted conductor never placed is freed from
what the API process says of it; an API process that dies has its legs freed; decode's heartbeats keep
the load view's progress."""

import time

import msgspec
import pytest
import zmq

from mooncake import messages as m
from mooncake.sampling import WireSampling
from tests.api.test_api import Served

REPORTS = "tcp://127.0.0.1:1"  # the stand-in API process's report address: carried, never dialled


@pytest.fixture()
def served(tiny_dir):
    s = Served(**{"conductor.heartbeat_timeout_s": 600.0, "conductor.admission": "accept-all"})  # no heartbeats here
    yield s
    s.close()


def dealer(served, identity: str, msg) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.connect(served.control)
    sock.send(m.encode(msg))
    reply = recv(sock)
    assert isinstance(reply, m.RegisterReply) and reply.accepted, reply
    return sock


def recv(sock, timeout_s: float = 10.0, kind=None):
    """The next message (of `kind`, skipping others) within the timeout."""
    deadline = time.monotonic() + timeout_s
    while sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
        msg = m.decode(sock.recv())
        if kind is None or isinstance(msg, kind):
            return msg
    raise AssertionError(f"nothing{f' of {kind.__name__}' if kind else ''} within {timeout_s} s")


def register(served, identity: str, role: str, **extra):
    return m.Register(instance_id=identity, role=role, model_id=served.conductor.model.model_id, block_size=64,
                      kv_dtype="float32", transport="tcp", data_address="tcp://127.0.0.1:2", **extra)


def cluster(served):
    prefill = dealer(served, "prefill-a", register(served, "prefill-a", "prefill"))
    decode = dealer(served, "decode-a", register(served, "decode-a", "decode"))
    api = dealer(served, "api-a", register(served, "api-a", "api"))
    return prefill, decode, api


def place(api, rid: str, tokens: int = 130, **extra):
    api.send(m.encode(m.Place(request_id=rid, token_ids=list(range(tokens)),
                              block_hashes=list(range(1000, 1000 + tokens // 64)),
                              sampling=WireSampling(max_tokens=8, temperature=0.0), reply_to=REPORTS, **extra)))
    return recv(api, kind=m.Placed)


def done(rid: str) -> m.PrefillDone:
    return m.PrefillDone(request_id=rid, first_token=5, finish_reason=None, num_cached_tokens=0,
                         num_computed_tokens=130, num_kv_blocks_sent=2, kv_bytes=1, kv_seconds=0.0,
                         prefill_seconds=0.01, compute_seconds=0.01)


def close(*socks):
    for sock in socks:
        sock.close(linger=0)


def test_a_leg_is_placed_handed_off_and_freed_with_the_api_process_named_as_its_report_address(served):
    prefill, decode, api = cluster(served)
    try:
        placed = place(api, "r1")
        assert not placed.refusal and placed.prefill_ids == ["prefill-a"] and placed.decode_id == "decode-a"
        sent = recv(prefill, kind=m.Prefill)
        assert sent.request_id == "r1" and sent.reply_to == REPORTS and sent.decode_id == "decode-a"
        assert place(api, "r1").refusal == "invalid"  # one leg, one placement
        api.send(m.encode(m.HandOff(done=done("r1"), decode_id="decode-a", token_ids=list(range(130)) + [5],
                                    block_hashes=[1000, 1001], sampling=WireSampling(max_tokens=7), reply_to=REPORTS)))
        claimed = recv(decode, kind=m.Decode)
        assert claimed.request_id == "r1" and claimed.reply_to == REPORTS and claimed.token_ids[-1] == 5
        decode.send(m.encode(m.Heartbeat(instance_id="decode-a", seq=1, decode=m.DecodeLoad(progress=[m.LegProgress("r1", 3)]))))
        deadline = time.monotonic() + 5
        while served.conductor.flights["r1"].num_decoded != 3:
            assert time.monotonic() < deadline, "decode's progress never reached the load view"
            time.sleep(0.02)
        api.send(m.encode(m.LegEnded(request_id="r1", outcome="cancelled")))
        assert recv(decode, kind=m.Cancel).request_id == "r1"
        deadline = time.monotonic() + 5
        while served.conductor.flights:
            assert time.monotonic() < deadline, "the ended leg stayed counted"
            time.sleep(0.02)
        assert not served.conductor.registry.get("decode-a").request_ids
    finally:
        close(prefill, decode, api)


def test_a_leg_the_conductor_never_placed_is_freed_where_its_api_process_says(served):
    prefill, decode, api = cluster(served)
    try:
        api.send(m.encode(m.LegEnded(request_id="old", outcome="error", holders=["prefill-a", "decode-a"],
                                     block_hashes=[7, 8])))
        assert recv(prefill, kind=m.Cancel).request_id == "old"
        cancel = recv(decode, kind=m.Cancel)
        assert cancel.request_id == "old" and cancel.block_hashes == [7, 8]  # its KV waiting in the inbox
    finally:
        close(prefill, decode, api)


def test_a_dead_api_process_has_its_legs_freed_everywhere(served):
    prefill, decode, api = cluster(served)
    try:
        assert not place(api, "r2").refusal
        recv(prefill, kind=m.Prefill)
        api.send(m.encode(m.Leave(instance_id="api-a")))  # NOTE: a clean departure: no grace
        assert recv(prefill, timeout_s=10, kind=m.Cancel).request_id == "r2"
        assert recv(decode, timeout_s=10, kind=m.Cancel).request_id == "r2"
        assert not served.conductor.flights
    finally:
        close(prefill, decode)


GRACE_S = 1.0


@pytest.fixture()
def graced(tiny_dir):
    s = Served(**{"conductor.heartbeat_timeout_s": 600.0, "conductor.admission": "accept-all",
                  "conductor.api_grace_s": GRACE_S})
    yield s
    s.close()


def silence(served, api_id: str) -> None:
    """As if `api_id` had sent no heartbeat for longer than the timeout: the liveness watch declares it dead."""
    instance = served.conductor.registry.get(api_id)
    served.loop.call_soon_threadsafe(setattr, instance, "last_seen_s", float("-inf"))
    deadline = time.monotonic() + 5
    while instance.is_alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not instance.is_alive


def placed_leg(prefill, api, rid: str) -> m.HeldLeg:
    assert not place(api, rid).refusal
    recv(prefill, kind=m.Prefill)
    return m.HeldLeg(rid, "decode-a", 130, 8, ["prefill-a"], list(range(1000, 1002)))


def test_an_api_process_silent_for_a_moment_keeps_its_legs_when_it_registers_again_within_the_grace(graced):
    """An overloaded API process that missed its heartbeats is not dead: its streams must go on untouched."""
    prefill, decode, api = cluster(graced)
    try:
        held = placed_leg(prefill, api, "r4")
        hand_off = m.HandOff(done=done("r4"), decode_id="decode-a", token_ids=list(range(130)) + [5],
                             block_hashes=[1000, 1001], sampling=WireSampling(max_tokens=7), reply_to=REPORTS)
        api.send(m.encode(hand_off))
        assert recv(decode, kind=m.Decode).request_id == "r4"
        silence(graced, "api-a")
        api.send(m.encode(register(graced, "api-a", "api", legs=[held])))
        assert recv(api, kind=m.RegisterReply).accepted
        api.send(m.encode(hand_off))  # NOTE: an API process sends again a hand-off with no token from decode yet
        assert not decode.poll(int(GRACE_S * 1000) + 1000) and not prefill.poll(0)  # no Cancel, no second Decode
        assert "r4" in graced.conductor.flights and graced.conductor.registry.get("api-a").request_ids == {"r4"}
        api.send(m.encode(m.LegEnded(request_id="r4", outcome="cancelled")))
        assert recv(decode, kind=m.Cancel).request_id == "r4"  # still its to end
    finally:
        close(prefill, decode, api)


def test_an_api_process_silent_past_the_grace_has_its_legs_freed_and_told_lost_if_it_comes_back(graced):
    prefill, decode, api = cluster(graced)
    try:
        held = placed_leg(prefill, api, "r5")
        silenced_s = time.monotonic()
        silence(graced, "api-a")
        assert recv(prefill, timeout_s=GRACE_S + 5, kind=m.Cancel).request_id == "r5"
        assert time.monotonic() - silenced_s >= GRACE_S * 0.9  # not before the grace ended
        assert recv(decode, kind=m.Cancel).request_id == "r5" and not graced.conductor.flights
        api.send(m.encode(register(graced, "api-a", "api", legs=[held])))  # too late: the instances freed it
        lost = recv(api, kind=m.LegLost)
        assert lost.request_id == "r5" and lost.suspects == [] and "api_grace_s" in lost.error
        assert not graced.conductor.flights  # not adopted: nothing holds its KV any more
    finally:
        close(prefill, decode, api)


def test_a_restarted_conductor_counts_the_legs_an_api_process_says_it_holds(served):
    prefill, decode, _ = cluster(served)
    held = [m.HeldLeg("d1", "decode-a", 200, 50), m.HeldLeg("p1", "decode-a", 70, 8, ["prefill-a"], [9])]
    api = dealer(served, "api-b", register(served, "api-b", "api", legs=held))
    try:
        flights = served.conductor.flights
        assert set(flights) == {"d1", "p1"} and not flights["d1"].in_prefill and flights["p1"].in_prefill
        assert served.conductor.registry.get("decode-a").request_ids == {"d1", "p1"}
        assert served.conductor.registry.get("prefill-a").request_ids == {"p1"}
        api.send(m.encode(m.LegEnded(request_id="p1", outcome="cancelled")))
        assert recv(prefill, kind=m.Cancel).request_id == "p1"
        assert recv(decode, kind=m.Cancel).block_hashes == [9]  # not claimed yet: named
    finally:
        close(prefill, decode, api)


def test_a_lost_decode_instance_is_told_to_the_api_process_that_owns_its_legs(served):
    prefill, decode, api = cluster(served)
    try:
        assert not place(api, "r3").refusal
        decode.send(m.encode(m.Leave(instance_id="decode-a")))  # as a silent one is, after the heartbeat timeout
        lost = recv(api, timeout_s=10, kind=m.LegLost)
        assert lost.request_id == "r3" and lost.suspects == ["decode-a"]
    finally:
        close(prefill, api)


def test_a_finished_requests_record_adds_to_the_conductors_histograms_as_if_it_had_seen_every_token(served):
    from mooncake.api.endings import _bucketed
    prefill, decode, api = cluster(served)
    other = dealer(served, "api-b", register(served, "api-b", "api"))
    gaps = [0.004, 0.02, 0.02, 0.3, 90.0]
    record = m.LegEnded(request_id="r9", outcome="ok", num_completion_tokens=6, num_legs=1, ttft_s=0.5,
                        predicted_ttft_s=0.25, gap_counts=_bucketed(gaps), gap_sum_s=sum(gaps),
                        mean_gap_s=sum(gaps) / 5, slow_gap_s=90.0)
    try:
        assert not place(api, "r9").refusal
        # NOTE: only the API process the leg was placed for may count its request, and once: not another
        # (an api key's holder skewing /metrics), nor a leg no conductor placed
        for sender, rid in ((other, "r9"), (api, "r10")):
            sender.send(m.encode(msgspec.structs.replace(record, request_id=rid)))
        time.sleep(0.5)
        assert 'mooncake_requests_total{outcome="ok"}' not in served.conductor.metrics.exposition().decode()
        api.send(m.encode(record))
        api.send(m.encode(record))
        deadline = time.monotonic() + 5
        while 'mooncake_requests_total{outcome="ok"} 1.0' not in (text := served.conductor.metrics.exposition()
                                                                    .decode()):
            assert time.monotonic() < deadline, "the record never reached the metrics"
            time.sleep(0.02)
        series = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("mooncake_"))
        assert float(series['mooncake_tbt_seconds_bucket{le="0.005"}']) == 1
        assert float(series['mooncake_tbt_seconds_bucket{le="0.025"}']) == 3
        assert float(series['mooncake_tbt_seconds_bucket{le="60.0"}']) == 4
        assert float(series['mooncake_tbt_seconds_count']) == 5
        assert float(series['mooncake_tbt_seconds_sum']) == pytest.approx(sum(gaps))
        assert float(series['mooncake_ttft_prediction_ratio_bucket{le="0.5"}']) == 1  # 0.25 / 0.5
        assert float(series['mooncake_slo_requests_total{within_slo="false"}']) == 1  # a 90 s gap
        time.sleep(0.3)  # the second copy of the record has come by now
        assert 'mooncake_requests_total{outcome="ok"} 1.0' in served.conductor.metrics.exposition().decode()
        # a leg that ended before its request's record came: another's record neither counts nor spoils it
        assert not place(api, "r11").refusal
        api.send(m.encode(m.LegEnded(request_id="r11")))
        other.send(m.encode(msgspec.structs.replace(record, request_id="r11")))
        api.send(m.encode(msgspec.structs.replace(record, request_id="r11")))
        deadline = time.monotonic() + 5
        while 'mooncake_requests_total{outcome="ok"} 2.0' not in served.conductor.metrics.exposition().decode():
            assert time.monotonic() < deadline, "the owner's late record was not counted"
            time.sleep(0.02)
    finally:
        close(prefill, decode, api, other)

"""The conductor's control socket under bad input: random well-formed-but-wrong and garbage frames never
end its receive loop, and a message naming an instance counts only from that instance's connection."""

import time
import urllib.request

import pytest
import zmq
from hypothesis import HealthCheck, given, settings

from mooncake import messages as m
from tests.api.test_api import Served
from tests.wire_fuzz import frames

@pytest.fixture(scope="module")
def cluster(tiny_dir):
    s = Served(**{"conductor.heartbeat_timeout_s": 600.0})  # the stand-ins never heartbeat
    socks = s.fake_instances()
    s.decode_sock = socks[1]
    yield s
    for sock in socks:
        sock.close(linger=0)
    s.close()


@pytest.fixture(scope="module")
def stranger(cluster):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"stranger")
    sock.connect(cluster.control)
    yield sock
    sock.close(linger=0)


def drain(sock, wait_s: float = 0.05) -> list:
    replies = []
    while sock.poll(int(wait_s * 1000)):
        replies.append(m.decode(sock.recv()))
    return replies


def alive(cluster) -> dict:
    return cluster.request("/health")[1]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frame=frames)
def test_random_frames_never_end_the_receive_loop(cluster, stranger, frame):
    stranger.send(frame)
    stranger.send(b"\xc1")  # always malformed: its ErrorReply proves the loop is still there
    deadline = time.monotonic() + 10
    replies = []
    while not any(isinstance(r, m.ErrorReply) and "not msgpack" in r.error for r in replies):
        assert time.monotonic() < deadline, "the conductor stopped answering"
        replies += drain(stranger)


def test_after_the_fuzzing_the_registered_instances_are_still_up(cluster, stranger):
    health = alive(cluster)
    assert health["prefill"] == ["prefill-x"] and health["decode"] == ["decode-x"]


@pytest.mark.parametrize("msg", [m.Leave(instance_id="prefill-x"),
                                 m.Heartbeat(instance_id="decode-x", num_running=999, num_kv_blocks=1)])
def test_a_message_naming_another_instance_changes_nothing(cluster, stranger, msg):
    drain(stranger)
    stranger.send(m.encode(msg))
    (reply,) = drain(stranger, 2.0)
    assert isinstance(reply, m.ErrorReply) and "own instance" in reply.error
    assert alive(cluster)["prefill"] == ["prefill-x"] and alive(cluster)["decode"] == ["decode-x"]
    metrics = urllib.request.urlopen(cluster.url + "/metrics", timeout=10).read().decode()
    assert 'mooncake_instance_running_requests{instance="decode-x"} 999' not in metrics


def test_a_second_connection_under_a_registered_identity_is_not_heard(cluster):
    impostor = zmq.Context.instance().socket(zmq.DEALER)
    impostor.setsockopt(zmq.LINGER, 0)
    impostor.setsockopt(zmq.IDENTITY, b"prefill-x")
    impostor.connect(cluster.control)
    try:
        impostor.send(m.encode(m.Leave(instance_id="prefill-x")))
        impostor.send(b"\xc1")
        assert not impostor.poll(1000)  # ZeroMQ refused the duplicate identity: no reply, no effect
        assert alive(cluster)["prefill"] == ["prefill-x"]
    finally:
        impostor.close(linger=0)


def test_a_refused_registration_reveals_nothing_of_the_cluster(cluster, stranger):
    drain(stranger)
    stranger.send(m.encode(m.Register(instance_id="stranger", role="decode", model_id="guess", block_size=7, kv_dtype="float32")))
    (reply,) = drain(stranger, 2.0)
    assert not reply.accepted and cluster.conductor.model.model_id not in reply.error
    assert "64" not in reply.error


def test_each_report_of_a_step_is_routed_and_a_leg_that_is_over_is_cancelled_one_by_one(cluster):
    sock = cluster.decode_sock
    drain(sock)
    sock.send(m.encode(m.StepTokens(reports=[
        m.Tokens(request_id="gone-1", token_ids=[5]),
        m.Tokens(request_id="gone-2", token_ids=[6], finish_reason="length"),  # ended: nothing to free
        m.Tokens(request_id="gone-3", token_ids=[7]),
    ])))
    replies = drain(sock, 2.0)
    assert [(type(r), r.request_id) for r in replies] == [(m.Cancel, "gone-1"), (m.Cancel, "gone-3")]

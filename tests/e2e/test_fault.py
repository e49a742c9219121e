"""Faults end to end: a client that goes away mid-stream; `kill -9` of the only decode process mid-stream
(the request has nowhere to move: it fails cleanly once conductor.token_timeout_s has passed without a
decode instance coming back); a restarted conductor. Migration between instances: test_migration.py."""

import json
import signal
import socket
import threading
import time
import urllib.request

import pytest
import zmq

from mooncake import messages as m
from mooncake import security
from tests.e2e.conftest import E2E_SETTINGS, make_cluster, metrics, post, wait_for

TOKEN_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    with make_cluster(tmp_path_factory, "tcp", **{"conductor.token_timeout_s": TOKEN_TIMEOUT_S}) as c:
        yield c


def cache_stats(cluster) -> dict:
    sock = security.client(zmq.Context.instance().socket(zmq.DEALER),
                           keys=security.load_keys(cluster.config.security.keys_dir), server="cache")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cluster.config.cache_client.nodes[0])
    try:
        sock.send(m.encode(m.Stats()))
        assert sock.poll(10_000), "the cache node did not answer"
        return m.decode(sock.recv()).stats
    finally:
        sock.close(linger=0)


def test_a_client_that_disconnects_mid_stream_frees_its_request_everywhere(cluster):
    body = json.dumps({"model": "tiny", "prompt": "Go on and on: " * 4, "max_tokens": 3500, "ignore_eos": True,
                       "stream": True}).encode()
    host, port = cluster.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        received = b""
        while received.count(b"data: ") < 3:
            received += sock.recv(65536)
    # The socket is closed: the conductor must cancel the request on decode and count it cancelled.
    cancelled = 'mooncake_requests_total{outcome="cancelled"}'
    wait_for(lambda: metrics(cluster.url).get(cancelled) == 1, 10, "the request counted as cancelled")
    used = 'mooncake_instance_kv_blocks_used{instance="decode-0"}'
    wait_for(lambda: metrics(cluster.url)[used] == 0, 10, "decode released the request's blocks")
    assert metrics(cluster.url)['mooncake_requests_in_flight{instance="decode-0"}'] == 0


def test_killing_decode_mid_stream_fails_the_request_cleanly_and_service_recovers(cluster):
    body = {"model": "tiny", "prompt": "A long story: " * 8, "max_tokens": 3500, "ignore_eos": True,
            "temperature": 0, "stream": True}
    req = urllib.request.Request(cluster.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    events, ended = [], threading.Event()

    def read():
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                if line.startswith(b"data: "):
                    events.append((time.monotonic(), line[6:].strip()))
        ended.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wait_for(lambda: len(events) >= 3, 60, "the first streamed tokens")
    killed_at = time.monotonic()
    cluster.kill("decode-0", signal.SIGKILL)
    assert ended.wait(30), "the stream did not end after its decode instance died"

    # A terminal error event, then the end of the stream (as vLLM does it).
    assert events[-1][1] == b"[DONE]"
    last_at, last = events[-2]
    assert b'"error"' in last, f"the request finished before decode was killed: {events[-2:]}"
    error = json.loads(last)["error"]
    assert "decode instance decode-0" in error["message"] and "could not move" in error["message"]
    assert error["type"] == "server_error"
    assert last_at - killed_at <= E2E_SETTINGS["conductor.heartbeat_timeout_s"] + TOKEN_TIMEOUT_S + 2.0
    assert len(events) < 3500  # it did not run to the end

    # Nothing of the failed request stays held: prefill's blocks (as its heartbeat reports them) and the
    # cache node's read leases.
    used = 'mooncake_instance_kv_blocks_used{instance="prefill-0"}'
    wait_for(lambda: metrics(cluster.url)[used] == 0, 5, "prefill released its blocks")
    wait_for(lambda: cache_stats(cluster)["leased_blocks"] == 0, 5, "the cache node released its leases")

    # With no decode instance the API says so; once one is back, requests succeed again.
    status, reply = post(cluster.url + "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert status == 503 and "decode" in reply["error"]["message"]
    cluster.spawn(cluster.process("decode-0"))
    cluster.wait_ready(120)
    status, reply = post(cluster.url + "/v1/completions", {"model": "tiny", "prompt": "hi again", "max_tokens": 5})
    assert status == 200 and reply["usage"]["completion_tokens"] == 5
    assert metrics(cluster.url)['mooncake_requests_total{outcome="error"}'] == 1
    assert metrics(cluster.url)['mooncake_migrations_total{outcome="no_instance"}'] == 1


def test_a_restarted_conductor_gets_its_instances_back(cluster):
    cluster.kill("conductor", signal.SIGKILL)
    cluster.spawn(cluster.process("conductor"))
    health = cluster.wait_ready(120)  # instances hear "unregistered" on their next heartbeat and rejoin
    assert health["prefill"] == ["prefill-0"] and health["decode"] == ["decode-0"]
    status, reply = post(cluster.url + "/v1/completions", {"model": "tiny", "prompt": "after the restart",
                                                           "max_tokens": 4})
    assert status == 200 and reply["usage"]["completion_tokens"] == 4

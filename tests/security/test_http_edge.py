"""The HTTP edge (issue: the body was parsed as JSON whatever its Content-Type and no Host was checked, so a
web page could drive a keyless local API; no header-read timeout held 300 slowloris connections; no TLS; a
placeholder key started without a word; no per-client limits). Each check over the real API in-process."""

import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.request

import pytest

from mooncake.api.edge import check_exposure
from mooncake.config import load_config
from mooncake.errors import ConfigError
from tests.api.test_api import Served, ok_body

KEY_A = "a" * 32
KEY_B = "b" * 32


@pytest.fixture(scope="module")
def keyless(tiny_dir):
    s = Served(**{"api.header_timeout_s": 0.5, "api.body_timeout_s": 0.5, "api.max_connections": 16})
    yield s
    s.close()


def _raw(url: str, data: bytes, read: bool = True, timeout_s: float = 5.0) -> bytes:
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(data)
        if not read:
            return b""
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < _length(reply):
            if not (chunk := sock.recv(65536)):
                break
            reply += chunk
        return reply


def _length(reply: bytes) -> int:
    for line in reply.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def test_a_body_that_is_not_declared_json_is_refused_before_any_work(keyless):
    """A page's simple cross-origin POST (text/plain, no preflight) is what CSRF sends."""
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        status, reply, _ = keyless.request("/v1/completions", ok_body(), headers={"Content-Type": content_type})
        assert status == 415 and reply["error"]["code"] == "unsupported_media_type", (content_type, reply)
    assert keyless.conductor.flights == {}
    assert 'mooncake_requests_total' not in keyless.conductor.metrics.exposition().decode().replace(
        "# HELP mooncake_requests_total", "").replace("# TYPE mooncake_requests_total", "")


def test_a_keyless_api_answers_only_its_own_host_names(keyless):
    """DNS rebinding: the attacker's name resolves to 127.0.0.1, and the browser sends it as the Host."""
    status, reply, _ = keyless.request("/v1/models", headers={"Host": "attacker.example:8000"})
    assert status == 403 and reply["error"]["code"] == "host_not_allowed"
    status, reply, _ = keyless.request("/v1/completions", ok_body(), headers={"Host": "attacker.example"})
    assert status == 403
    for host in ("127.0.0.1:8000", "localhost", "[::1]:8000"):
        assert keyless.request("/v1/models", headers={"Host": host})[0] == 200, host


def test_slowloris_connections_are_closed_after_the_header_timeout(keyless):
    url = keyless.url
    host, port = url.split("//")[1].split(":")
    socks = []
    started = time.monotonic()
    for _ in range(12):
        sock = socket.create_connection((host, int(port)), timeout=5)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # and never the rest
        socks.append(sock)
    try:
        for sock in socks:
            assert sock.recv(1024) == b""  # the server closed it
        assert time.monotonic() - started < 4.0
        assert keyless.request("/v1/models")[0] == 200  # and serves the next client
    finally:
        for sock in socks:
            sock.close()


def test_a_body_that_stalls_is_answered_408(keyless):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{\"model\"")
    started = time.monotonic()
    reply = _raw(keyless.url, head)
    assert reply.startswith(b"HTTP/1.1 408") and b"api.body_timeout_s" in reply, reply[:200]
    assert time.monotonic() - started < 4.0


def test_connections_past_the_limit_get_503(keyless):
    url = keyless.url
    host, port = url.split("//")[1].split(":")
    server = keyless.api.runner.server
    deadline = time.monotonic() + 5
    while server.connections and time.monotonic() < deadline:  # earlier tests' connections: idle, closing
        time.sleep(0.05)
    held = [socket.create_connection((host, int(port)), timeout=5) for _ in range(16)]
    try:
        time.sleep(0.1)
        reply = _raw(url, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 503") and b"api.max_connections" in reply, reply[:200]
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    assert keyless.request("/v1/models")[0] == 200


def test_a_placeholder_key_or_no_key_beyond_loopback_does_not_start():
    for key in ("change-me", "changeme"):
        with pytest.raises(ConfigError, match="api.api_key.*placeholder"):
            load_config(None, {"api.api_key": key})
    with pytest.raises(ConfigError, match="api.keys"):
        load_config(None, {"api.keys": [{"key": "short"}]})
    exposed = {"api.host": "198.18.0.10"}
    with pytest.raises(ConfigError, match="api.api_key.*198.18.0.10.*security.insecure"):
        check_exposure(load_config(None, exposed))
    check_exposure(load_config(None, {**exposed, "api.api_key": KEY_A}))
    check_exposure(load_config(None, {**exposed, "security.insecure": True}))
    check_exposure(load_config(None))  # loopback, no key


def test_metrics_and_health_may_need_a_key_of_their_own(tiny_dir):
    s = Served(**{"api.metrics_key": KEY_B, "api.api_key": KEY_A})
    try:
        for path in ("/metrics", "/health"):
            assert s.request(path)[0] == 401
            assert s.request(path, headers={"Authorization": f"Bearer {KEY_A}"})[0] == 401  # not the API's key
        req = urllib.request.Request(s.url + "/metrics", headers={"Authorization": f"Bearer {KEY_B}"})
        assert urllib.request.urlopen(req, timeout=10).status == 200
        assert s.request("/health", headers={"Authorization": f"Bearer {KEY_B}"})[0] == 503  # no instances: 503
    finally:
        s.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls(tiny_dir, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    s = Served(**{"api.tls_cert": str(cert), "api.tls_key": str(key)})
    try:
        assert s.url.startswith("https://")
        context = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(s.url + "/v1/models", context=context, timeout=10) as r:
            assert r.status == 200
        with pytest.raises(OSError):  # plain HTTP on the TLS port gets no answer
            urllib.request.urlopen(s.url.replace("https", "http") + "/v1/models", timeout=5).read()
    finally:
        s.close()
    with pytest.raises(ConfigError, match="api.tls_cert"):
        load_config(None, {"api.tls_cert": str(cert)})


def test_each_key_has_its_own_limits(tiny_dir):
    s = Served(**{"api.keys": [{"key": KEY_A, "name": "team-a", "max_concurrent_requests": 2,
                                "max_outstanding_tokens": 100}, {"key": KEY_B, "name": "team-b"}],
                  "conductor.prefill_timeout_s": 2.0, "conductor.token_timeout_s": 2.0})
    socks = s.fake_instances()  # they take requests and never answer: each stays in flight until its timeout
    a, b = ({"Authorization": f"Bearer {k}"} for k in (KEY_A, KEY_B))
    try:
        assert s.request("/v1/models")[0] == 401
        held = [threading.Thread(target=s.request, args=("/v1/completions", ok_body(max_tokens=4), a))
                for _ in range(2)]
        for t in held:
            t.start()
        deadline = time.monotonic() + 10
        while len(s.conductor.flights) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        status, reply, headers = s.request("/v1/completions", ok_body(max_tokens=4), a)
        assert status == 429 and reply["error"]["code"] == "key_requests_limit" and headers["Retry-After"] == "1"
        assert "team-a" in reply["error"]["message"]
        status, reply, _ = s.request("/v1/completions", ok_body(max_tokens=200), a)
        assert status == 400 and reply["error"]["code"] == "key_tokens_limit"
        # more choices than the key may ever run at once: no retry would help
        status, reply, _ = s.request("/v1/completions", ok_body(max_tokens=4, prompt=["x", "y", "z"]), a)
        assert status == 400 and reply["error"]["code"] == "key_requests_limit", reply
        # another key is not held back by team-a's load: its three choices are placed too
        held.append(threading.Thread(target=s.request, args=("/v1/completions", ok_body(max_tokens=4, n=3), b)))
        held[-1].start()
        while len(s.conductor.flights) < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(s.conductor.flights) == 5
        for t in held:
            t.join(30)
        tenant = next(t for t in s.api.edge.tenants.values() if t.name == "team-a")
        assert tenant.num_requests == 0 and tenant.num_tokens == 0  # what ended is counted no more
    finally:
        for sock in socks:
            sock.close(linger=0)
        s.close()

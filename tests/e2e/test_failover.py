"""A standby conductor takes over from a killed leader, with leadership from etcd (Debian's etcd-server,
started here on loopback): running streams go on untouched, and new requests are placed by the standby
once the leader's lease ends. Skipped where etcd is not installed, except in CI (where it must be)."""

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request

import pytest

from mooncake.dev import free_port
from tests.e2e.conftest import make_cluster, wait_for
from tests.e2e.test_front_door import ask
from tests.e2e.test_migration import Stream, assert_idle, story

pytestmark = pytest.mark.slow  # make test skips it; make test-all and .ci/run run it

LEADER_TTL_S = 2.0


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    binary = shutil.which("etcd")
    if binary is None:
        if os.environ.get("MOONCAKE_REQUIRE_ALL_BACKENDS"):
            pytest.fail("etcd is not installed (Debian: apt-get install etcd-server)")
        pytest.skip("etcd is not installed (Debian: apt-get install etcd-server)")
    client, peer = free_port(), free_port()
    data = tmp_path_factory.mktemp("etcd")
    proc = subprocess.Popen([binary, "--name", "t", "--data-dir", str(data),
                             "--listen-client-urls", f"http://127.0.0.1:{client}",
                             "--advertise-client-urls", f"http://127.0.0.1:{client}",
                             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"t=http://127.0.0.1:{peer}"],
                            stdout=subprocess.DEVNULL, stderr=open(data / "etcd.log", "wb"))
    url = f"http://127.0.0.1:{client}"

    def healthy() -> bool:
        try:
            return json.loads(urllib.request.urlopen(url + "/health", timeout=1).read()).get("health") == "true"
        except OSError:
            return False
    try:
        wait_for(healthy, 30, "etcd answering")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def cluster(etcd, tiny_dir, tmp_path_factory):
    with make_cluster(tmp_path_factory, "tcp", num_prefill=1, num_decode=1, num_standby=1,
                      **{"conductor.etcd_endpoints": [etcd], "conductor.leader_ttl_s": LEADER_TTL_S,
                         "conductor.etcd_key": f"/mooncake-test/{free_port()}/leader",
                         "api.conductor_wait_s": 2.0}) as c:
        yield c


def log_of(cluster, name: str) -> str:
    return (cluster.workdir / f"{name}.log").read_text()


def test_a_standby_conductor_takes_over_and_running_streams_never_notice(cluster):
    # NOTE: both start at once: either may win the first election
    leader, standby = sorted(("conductor", "conductor-1"), key=lambda name: "leading" not in log_of(cluster, name))
    assert "leading" in log_of(cluster, leader) and "standby" in log_of(cluster, standby)
    bodies = [story(400) for _ in range(4)]
    reference = [s.result() for s in [Stream(cluster.url, body) for body in bodies]]
    streams = [Stream(cluster.url, body) for body in bodies]
    wait_for(lambda: all(len(s.token_ids) >= 10 for s in streams), 60, "every stream's first tokens")
    cluster.kill(leader, signal.SIGKILL)
    killed = time.monotonic()
    placed_s = None
    while placed_s is None and time.monotonic() - killed < LEADER_TTL_S + 30:
        status, reply, headers = ask(cluster.url, story(2))
        if status == 200:
            placed_s = time.monotonic() - killed
        else:
            assert status == 503 and "Retry-After" in headers, (status, reply)
    assert placed_s is not None, "the standby never placed a request"
    print(f"the standby placed a new request {placed_s:.2f} s after the leader was killed")
    assert "leading" in log_of(cluster, standby)
    for stream, tokens in zip(streams, reference):
        assert stream.result() == tokens and stream.finish_reason == "length"
    assert_idle(cluster)

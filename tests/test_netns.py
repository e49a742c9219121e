"""NetnsLab: hosts in network namespaces reach each other over the bridge, `cut` isolates one, and
`stop` leaves nothing behind. Traffic goes only to the lab's own 198.18 addresses; every wait is bounded."""

import os
import select
import subprocess
import sys
import time

import pytest

from mooncake.errors import MooncakeError
from mooncake.netns import NetnsLab, _ip, netns_unavailable

# Echoes one message per connection; prints its port once listening so the test knows it is ready.
ECHO_SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 0))
s.listen()
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    try:
        c.settimeout(5)
        c.sendall(c.recv(1024))
    except OSError:
        pass
    finally:
        c.close()
"""
ECHO_CLIENT = ("import socket, sys; c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2); "
               "c.sendall(b'ping'); print(c.recv(1024).decode())")
CONNECT_TIMEOUT_S = 2.0


@pytest.fixture(scope="module", autouse=True)
def netns_required():
    reason = netns_unavailable()
    if reason:
        if os.environ.get("MOONCAKE_REQUIRE_ALL_BACKENDS"):
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def echo_lab(netns_required):
    """Two hosts, an echo server on host 0; yields (lab, port). Kills only the server it started."""
    with NetnsLab(2) as lab:
        server = lab.popen(lab.hosts[0], [sys.executable, "-c", ECHO_SERVER, lab.hosts[0].address],
                           stdout=subprocess.PIPE, text=True)
        try:
            ready, _, _ = select.select([server.stdout], [], [], 10.0)
            assert ready, "echo server did not report its port within 10s"
            port = int(server.stdout.readline())
            yield lab, port
        finally:
            server.kill()
            server.wait(timeout=10)


def echo_from(lab, host, address, port) -> subprocess.CompletedProcess:
    return lab.run(host, [sys.executable, "-c", ECHO_CLIENT, address, str(port)], timeout_s=15.0)


def test_hosts_reach_each_other_and_the_root_reaches_them(echo_lab):
    import socket
    lab, port = echo_lab
    h0, h1 = lab.hosts
    assert h0.address != h1.address and h0.address.startswith("198.18.")
    done = echo_from(lab, h1, h0.address, port)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ping"
    with socket.create_connection((h0.address, port), timeout=CONNECT_TIMEOUT_S) as c:
        c.settimeout(CONNECT_TIMEOUT_S)
        c.sendall(b"root")
        assert c.recv(1024) == b"root"


def test_cut_isolates_a_host_and_restore_reconnects_it(echo_lab):
    lab, port = echo_lab
    h0, h1 = lab.hosts
    lab.cut(h0)
    try:
        began = time.monotonic()
        done = echo_from(lab, h1, h0.address, port)
        assert done.returncode != 0, "a cut host was still reachable"
        assert time.monotonic() - began < CONNECT_TIMEOUT_S + 5.0
    finally:
        lab.restore(h0)
    deadline = time.monotonic() + 10.0
    while True:
        done = echo_from(lab, h1, h0.address, port)
        if done.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ping"


def lab_names(lab) -> list[str]:
    return [lab.bridge, *(h.netns for h in lab.hosts), *(h.veth for h in lab.hosts)]


def leftovers(lab) -> list[str]:
    shown = _ip("netns", "list").stdout + _ip("-o", "link").stdout
    return [name for name in lab_names(lab) if name in shown] + ([lab.prefix] if lab.prefix in shown else [])


def test_stop_leaves_nothing_behind(netns_required):
    lab = NetnsLab(2)
    lab.start()
    try:
        assert not lab.run(lab.hosts[0], ["true"], timeout_s=10.0).returncode
        sleeper = lab.popen(lab.hosts[1], ["sleep", "60"])  # a live process must not pin the namespace
    finally:
        lab.stop()
    assert sleeper.poll() is not None
    lab.stop()  # idempotent
    assert leftovers(lab) == []


def test_failed_start_undoes_what_it_made(netns_required):
    lab = NetnsLab(2)
    _ip("netns", "add", lab.hosts[1].netns)  # host 1's namespace already exists: start fails midway
    try:
        with pytest.raises(MooncakeError, match=r"ip netns add .*h1"):
            lab.start()
        assert [n for n in lab_names(lab) if n != lab.hosts[1].netns and n in
                _ip("netns", "list").stdout + _ip("-o", "link").stdout] == []
    finally:
        _ip("netns", "delete", lab.hosts[1].netns, check=False)
        lab.stop()
    assert leftovers(lab) == []

"""A cluster of real processes (with keys, as `mooncake dev` runs it) under random frames at every socket a
role listens on: the conductor's control socket, a cache node's control socket, the cache node's and the
decode inbox's transport endpoints. Sent by a stranger without keys and by a peer holding the cluster's
keys; afterwards every role is still up and answering, and the cluster serves a completion."""

import itertools
import re
import time

import pytest
import zmq
from hypothesis import HealthCheck, given, settings

from mooncake import messages as m
from mooncake import security
from mooncake.config import load_config
from mooncake.transfer.framing import binding, seal_for
from tests.e2e.conftest import make_cluster, post
from tests.wire_fuzz import frames

pytestmark = pytest.mark.slow  # make test skips it; make test-all and .ci/run run it


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    with make_cluster(tmp_path_factory, "tcp") as c:
        yield c


def listening(cluster) -> dict[str, str]:
    """Every address a role of the cluster listens on, by what it is."""
    log = (cluster.workdir / "conductor.log").read_text()
    inbox = re.search(r"KV inbox (tcp://\S+) over tcp", log)[1]
    keys = security.load_keys(cluster.config.security.keys_dir)
    sock = dealer(cluster.config.cache_client.nodes[0], keys)
    sock.send(m.encode(m.Hello()))
    assert sock.poll(10_000), "the cache node did not answer"
    hello = m.decode(sock.recv())
    sock.close()
    reports = re.search(r"reports at (tcp://\S+)", (cluster.workdir / "api-0.log").read_text())[1]
    return {"conductor control": cluster.config.conductor.control_address, "api control": reports,
            "cache control": cluster.config.cache_client.nodes[0],
            "cache data": hello.data_address, "decode inbox": inbox}


def dealer(address: str, keys=None, server: str = "cache", data: bool = False) -> zmq.Socket:
    """`keys`: a member's, for a control socket (CURVE); `data`: a data socket, with this process's data
    plane password when it holds the cluster's keys."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 200)  # a refused handshake leaves nothing to queue on: never wait long
    if keys is not None:
        security.client(sock, keys=keys, server=server)
    elif data:
        security.client(sock, curve=False)
    sock.connect(address)
    return sock


@pytest.mark.parametrize("who", ["stranger", "member"])
def test_random_frames_at_every_listening_socket_leave_every_role_serving(cluster, who):
    keys = security.load_keys(cluster.config.security.keys_dir) if who == "member" else None
    if keys is not None:  # a member also seals its transport messages with the cluster's MAC
        security.configure(load_config(None, {"security.keys_dir": cluster.config.security.keys_dir}))
    # NOTE: control sockets are CURVE; a transport's data socket is plain and its messages sealed instead.
    addresses = listening(cluster)
    sockets = {name: dealer(address, keys if "control" in name else None, name.split()[0], "control" not in name)
               for name, address in addresses.items()}
    counter = itertools.count(1)
    try:
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
        @given(frame=frames, block=frames)
        def one(frame, block):
            for name, sock in sockets.items():
                # A transport message is [MAC, binding, header, blocks]: a member's MAC is right (its random
                # header reaches the handler); a stranger's is empty (no keys here), so it is dropped unread.
                bind = binding(b"fuzzer", next(counter))
                parts = [frame] if "control" in name else [seal_for(bind, addresses[name], frame), bind, frame, block]
                try:
                    sock.send_multipart(parts)
                except zmq.Again:
                    assert who == "stranger", f"a member could not reach the {name}"
                while sock.poll(0):
                    sock.recv_multipart()
        one()
        time.sleep(0.5)
    finally:
        for sock in sockets.values():
            sock.close()
        security.reset()
    for proc in cluster.processes:
        assert proc.popen.poll() is None, f"{proc.name} exited"
    health = cluster.health()
    assert health["prefill"] == ["prefill-0"] and health["decode"] == ["decode-0"] and health["cache"] == ["cache-0"]
    status, reply = post(cluster.url + "/v1/completions", {"model": "tiny", "prompt": "still serving?",
                                                           "max_tokens": 4, "temperature": 0})
    assert status == 200 and reply["usage"]["completion_tokens"] == 4, reply

"""Roles have their own keys (issue: one key pair for every role, so a cache node's host could register
its own prefill and decode instances, receive other users' prompts and write their answers). The
conductor's control socket admits only instance keys, and an instance key registers only its own role."""

import threading

import pytest
import zmq

from mooncake import messages as m
from mooncake import security
from mooncake.config import load_config
from mooncake.errors import ConfigError
from tests.api.test_api import Served


@pytest.fixture
def cluster_keys(tmp_path):
    directory = security.generate_keys(tmp_path / "keys")
    security.configure(load_config(None, {"security.keys_dir": str(directory)}))  # this test: an instance
    yield directory
    security.reset()


def _ask(served, role_key: str, identity: str, register_as: str, keys_dir):
    """Register `identity` as a `register_as` instance over a connection holding `role_key`'s key; the
    reply, or None when the connection is refused (no reply at all)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    security.client(sock, keys=security.load_keys(keys_dir, role_key), server="conductor")
    sock.connect(served.control)
    try:
        sock.send(m.encode(m.Register(instance_id=identity, role=register_as, model_id=served.conductor.model.model_id,
                                      block_size=64, kv_dtype="float32", transport="tcp",
                                      data_address="tcp://127.0.0.1:1")))
        return m.decode(sock.recv()) if sock.poll(3000) else None
    finally:
        sock.close()


def test_a_key_acts_only_as_its_own_role(tiny_dir, cluster_keys):
    served = Served(**{"security.keys_dir": str(cluster_keys), "conductor.heartbeat_timeout_s": 600.0})
    try:
        assert _ask(served, "prefill", "prefill-a", "prefill", cluster_keys).accepted
        assert _ask(served, "decode", "decode-a", "decode", cluster_keys).accepted
        refused = _ask(served, "decode", "prefill-b", "prefill", cluster_keys)  # a decode key as prefill
        assert not refused.accepted and "decode's; it may not register a prefill" in refused.error
        # a cache node's and the conductor's own keys cannot even connect to the control socket
        assert _ask(served, "cache", "decode-c", "decode", cluster_keys) is None
        assert _ask(served, "conductor", "decode-d", "decode", cluster_keys) is None
        health = served.request("/health")[1]
        assert health["prefill"] == ["prefill-a"] and health["decode"] == ["decode-a"]
    finally:
        served.close()


def test_a_host_holds_only_the_secrets_of_its_roles(tmp_path, cluster_keys):
    """A cache host's directory: the public keys, its own secret and the data secret, nothing else: it
    configures as a cache and holds no instance's secret."""
    host = tmp_path / "cache-host"
    host.mkdir(mode=0o700)
    for path in cluster_keys.iterdir():
        if path.name.endswith(".key") or path.name in ("cache.key_secret", security.DATA_SECRET):
            (host / path.name).write_bytes(path.read_bytes())
    security.configure(load_config(None, {"security.keys_dir": str(host)}), "cache")
    with pytest.raises(ConfigError, match="prefill key pair"):
        security.load_keys(host, "prefill")


def test_a_key_speaks_only_for_instances_of_its_own_role(tiny_dir, cluster_keys):
    """A key holder who connects under the id of a registered instance of another role (after that one's
    connection closed) cannot speak for it: every message, not only Register, is checked against the
    registered role."""
    served = Served(**{"security.keys_dir": str(cluster_keys), "conductor.heartbeat_timeout_s": 600.0})
    ctx = zmq.Context.instance()

    def connect(role_key: str, identity: str):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        security.client(sock, keys=security.load_keys(cluster_keys, role_key), server="conductor")
        sock.connect(served.control)
        return sock

    def snapshot(sock, seq: int):
        sock.send(m.encode(m.Heartbeat(instance_id="prefill-a", num_kv_blocks=64, seq=seq,
                                       cache=m.CacheChanges(added=[11, 12, 13], is_snapshot=True))))
        return m.decode(sock.recv()) if sock.poll(3000) else None

    try:
        own = connect("prefill", "prefill-a")
        own.send(m.encode(m.Register(instance_id="prefill-a", role="prefill", num_kv_blocks=64,
                                     model_id=served.conductor.model.model_id, block_size=64, kv_dtype="float32",
                                     transport="tcp", data_address="tcp://127.0.0.1:1")))
        assert own.poll(10_000) and m.decode(own.recv()).accepted
        own.close()
        impostor = connect("decode", "prefill-a")  # the same id, once the real one's connection is gone
        refused = None
        for _ in range(20):  # the conductor may still see the old connection for a moment
            refused = snapshot(impostor, 1)
            if refused is not None and "key" in getattr(refused, "error", ""):
                break
        assert isinstance(refused, m.ErrorReply) and "decode's" in refused.error, refused
        assert served.conductor.index.count("prefill-a") == 0  # nothing it said was believed
        impostor.send(m.encode(m.Register(instance_id="prefill-a", role="decode", num_kv_blocks=64,  # nor take it over
                                          model_id=served.conductor.model.model_id, block_size=64,
                                          kv_dtype="float32", transport="tcp", data_address="tcp://127.0.0.1:1")))
        taken = recv_kind(impostor, m.RegisterReply)
        assert not taken.accepted and "live prefill instance" in taken.error, taken
        assert served.conductor.registry.get("prefill-a").role == "prefill"
        impostor.close()
        own = connect("prefill", "prefill-a")  # the instance's own key still speaks for it
        for seq in range(1, 21):  # until the ROUTER has let go of the impostor's connection under the same id
            snapshot(own, seq)
            if served.conductor.index.count("prefill-a") == 3:
                break
        assert served.conductor.index.count("prefill-a") == 3
        own.close()
    finally:
        served.close()


def recv_kind(sock, kind, timeout_ms: int = 5000):
    """The next message of `kind` on `sock` (skipping others), or None."""
    while sock.poll(timeout_ms):
        msg = m.decode(sock.recv())
        if isinstance(msg, kind):
            return msg
    return None


def test_an_api_process_believes_a_report_only_over_the_key_of_the_role_that_holds_the_leg(tiny_dir, cluster_keys):
    """A decode key holder who connects to an API process's report socket under the id of the prefill
    instance a request was placed on cannot report for it (say, its first token); the prefill's own key can."""
    served = Served(**{"security.keys_dir": str(cluster_keys), "conductor.heartbeat_timeout_s": 600.0})
    ctx = zmq.Context.instance()

    def dealer(role_key: str, identity: str, address: str, server: str):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        security.client(sock, keys=security.load_keys(cluster_keys, role_key), server=server)
        sock.connect(address)
        return sock

    socks = []
    try:
        for role in ("prefill", "decode"):
            sock = dealer(role, f"{role}-a", served.control, "conductor")
            socks.append(sock)
            sock.send(m.encode(m.Register(instance_id=f"{role}-a", role=role, num_kv_blocks=64,
                                          model_id=served.conductor.model.model_id, block_size=64, kv_dtype="float32",
                                          transport="tcp", data_address="tcp://127.0.0.1:1")))
            assert sock.poll(10_000) and m.decode(sock.recv()).accepted
        answer = []
        client = threading.Thread(target=lambda: answer.append(served.request("/v1/completions", {
            "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1})), daemon=True)
        client.start()
        assert socks[0].poll(10_000), "no Prefill reached prefill-a"
        prefill = m.decode(socks[0].recv())
        assert isinstance(prefill, m.Prefill) and prefill.reply_to
        done = m.PrefillDone(request_id=prefill.request_id, first_token=9, finish_reason="length", num_cached_tokens=0,
                             num_computed_tokens=3, num_kv_blocks_sent=0, kv_bytes=0, kv_seconds=0.0,
                             prefill_seconds=0.01, compute_seconds=0.01)
        impostor = dealer("decode", "prefill-a", prefill.reply_to, "api")
        impostor.send(m.encode(done))
        client.join(2.0)
        assert client.is_alive() and not answer, f"a decode key reported prefill-a's first token: {answer}"
        impostor.close()
        for _ in range(50):  # the report socket may still hold the impostor's connection for a moment
            own = dealer("prefill", "prefill-a", prefill.reply_to, "api")
            own.send(m.encode(done))
            client.join(0.2)
            own.close()
            if not client.is_alive():
                break
        status, body, _ = answer[0]
        assert status == 200 and body["usage"]["completion_tokens"] == 1, body
    finally:
        for sock in socks:
            sock.close()
        served.close()


def test_a_host_with_another_clusters_keys_is_told_so_and_so_is_the_conductor(tiny_dir, cluster_keys, tmp_path,
                                                                                caplog):
    """A wrong key pair must not look like a conductor that is not there: the link logs that its handshake
    failed and why, and the conductor that a stranger's key cannot reach logs it too."""
    import asyncio
    import logging

    from mooncake.link import ConductorLink
    from mooncake.runtime import Supervisor
    served = Served(**{"security.keys_dir": str(cluster_keys)})
    other = security.generate_keys(tmp_path / "other")
    caplog.set_level(logging.WARNING)
    try:
        security.configure(load_config(None, {"security.keys_dir": str(other)}))  # this "host": another set

        async def try_to_join():
            register = m.Register(instance_id="decode-z", role="decode", model_id="m", block_size=64,
                                  kv_dtype="float32", transport="tcp", data_address="tcp://127.0.0.1:1")
            link = ConductorLink(served.control, register, lambda: m.Heartbeat(instance_id="decode-z"),
                                 lambda msg: asyncio.sleep(0), Supervisor("test"))
            await link.start()
            await asyncio.sleep(2.0)
            assert not link.registered.is_set()
            await link.stop()
        asyncio.run(try_to_join())
        said = [r.getMessage() for r in caplog.records]
        assert any("did not complete the CURVE handshake" in line and "keys" in line for line in said), said
        assert any("failed the CURVE handshake on the control socket" in line for line in said), said
    finally:
        security.configure(load_config(None, {"security.keys_dir": str(cluster_keys)}))
        served.close()

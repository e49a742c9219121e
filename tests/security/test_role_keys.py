"""Roles have their own keys (issue: one key pair for every role, so a cache node's host could register
its own prefill and decode instances, receive other users' prompts and write their answers). The
conductor's control socket admits only instance keys, and an instance key registers only its own role."""

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

"""Only the cluster talks to the cluster: keys, the loopback-only rule, and peers without the cluster key
getting no reply and changing nothing at the conductor, a cache node and a transport endpoint."""

import asyncio
import signal
import stat

import pytest
import zmq
from hypothesis import HealthCheck, given, settings

from mooncake import messages as m
from mooncake import security
from mooncake.config import CacheClientConfig, load_config
from mooncake.errors import ConfigError
from mooncake.store.client import CacheClient
from mooncake.transfer.contract import TransferError
from tests.wire_fuzz import frames


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("keys") / "cluster"
    security.generate_keys(directory)
    return directory


@pytest.fixture
def keyed(keys_dir):
    """This test process holds the cluster's keys, as a role would."""
    security.configure(load_config(None, {"security.keys_dir": str(keys_dir)}))
    yield security.load_keys(keys_dir)
    security.reset()


def test_generated_keys_are_private_and_never_overwritten(keys_dir):
    assert stat.S_IMODE(keys_dir.stat().st_mode) == 0o700
    for role in security.ROLES:
        assert stat.S_IMODE((keys_dir / f"{role}.key_secret").stat().st_mode) == 0o600
        keys = security.load_keys(keys_dir, role)
        assert len(keys.public) == len(keys.secret) == 40 and keys.role == role
    assert stat.S_IMODE((keys_dir / security.DATA_SECRET).stat().st_mode) == 0o600
    assert len({security.load_keys(keys_dir, r).public for r in security.ROLES}) == len(security.ROLES)
    with pytest.raises(ConfigError, match="holds cluster keys already"):
        security.generate_keys(keys_dir)


def test_a_missing_key_pair_is_a_config_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="security.keys_dir.*mooncake keys generate"):
        security.load_keys(tmp_path)


def test_without_keys_a_role_runs_on_loopback_only_unless_told_otherwise():
    security.configure(load_config(None))  # every default address is loopback
    exposed = {"instance.conductor_address": "tcp://198.18.0.10:7700"}
    with pytest.raises(ConfigError, match="198.18.0.10.*security.keys_dir.*security.insecure"):
        security.configure(load_config(None, exposed))
    security.configure(load_config(None, {**exposed, "security.insecure": True}))
    assert not security.is_secured()


def dealer(address, keys=None, identity: bytes | None = None, server: str = "cache"):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if keys is not None:
        security.client(sock, keys=keys, server=server)
    sock.connect(address)
    return sock


def answered(sock, msg, wait_s=1.0):
    """The reply to `msg`, or None if none came within `wait_s` (or it could not even be sent: a DEALER
    whose handshake was refused has no connection to queue it on)."""
    try:
        sock.send(m.encode(msg), zmq.NOBLOCK)
    except zmq.Again:
        return None
    return m.decode(sock.recv()) if sock.poll(int(wait_s * 1000)) else None


@pytest.fixture
def cache_node(tmp_path, keys_dir):
    from tests.store.test_cache_role import CacheNode
    node = CacheNode(tmp_path, keys_dir=keys_dir)
    try:
        yield node.start()
    finally:  # also when it never came up: end the process we started
        node.stop(signal.SIGKILL)


def test_a_cache_node_ignores_peers_without_the_cluster_key(cache_node, keyed, keys_dir, tmp_path):
    other_dir = tmp_path / "other-cluster"
    security.generate_keys(other_dir)

    async def run():
        client = CacheClient(CacheClientConfig(nodes=(cache_node.control,), timeout_s=3.0))
        await client.start()
        try:
            assert await client.put_blocks([(7, b"kv" * 100)]) == {7: None}
            hello = client.nodes[0].hello
            for keys in (None, security.load_keys(other_dir)):  # a stranger; another cluster's member
                sock = dealer(cache_node.control, keys)
                assert answered(sock, m.Remove(keys=[7])) is None
                assert answered(sock, m.Stats()) is None
                sock.close()
            # A block put straight to the data endpoint without the key is never heard either.
            security.reset()
            from backends.transports.tcp import TcpTransport
            async with TcpTransport() as stranger:
                await stranger.start()
                with pytest.raises(TransferError):
                    await stranger.send(hello.data_address, [(8, b"poison" * 100)], timeout_s=1.0)
            security.configure(load_config(None, {"security.keys_dir": str(keys_dir)}))
            assert (await client.get_blocks([7, 8])) == {7: b"kv" * 100, 8: None}
        finally:
            await client.stop()
    asyncio.run(run())


def test_random_frames_from_a_keyed_peer_never_end_a_cache_nodes_control_loop(cache_node, keyed):
    sock = dealer(cache_node.control, keyed)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(frame=frames)
    def one(frame):
        sock.send(frame)
        assert sock.poll(5000), "the cache node stopped answering"
        sock.recv()

    try:
        one()
        assert isinstance(answered(sock, m.Hello(), 5.0), m.HelloReply)
    finally:
        sock.close()


def test_the_conductor_ignores_peers_without_the_cluster_key(tiny_dir, keyed):
    from tests.api.test_api import Served
    served = Served(**{"conductor.heartbeat_timeout_s": 600.0})
    member = dealer(served.control, keyed, b"prefill-k", server="conductor")
    try:
        register = m.Register(instance_id="prefill-k", role="prefill", model_id=served.conductor.model.model_id,
                              block_size=64, kv_dtype="float32")
        assert answered(member, register, 10.0).accepted
        stranger = dealer(served.control, identity=b"decode-s")
        for msg in (m.Register(instance_id="decode-s", role="decode", model_id=served.conductor.model.model_id,
                               block_size=64, kv_dtype="float32", transport="tcp", data_address="tcp://127.0.0.1:1"),
                    m.Leave(instance_id="prefill-k"), m.Heartbeat(instance_id="prefill-k", num_running=99)):
            assert answered(stranger, msg) is None
        stranger.close()
        health = served.request("/health")[1]
        assert health["prefill"] == ["prefill-k"] and health["decode"] == []
        assert isinstance(answered(member, m.Hello()), m.ErrorReply)  # the member is still heard
    finally:
        member.close()
        served.close()


@pytest.mark.parametrize("name", ["tcp", "shm", "mooncake"])
def test_keyed_transports_move_blocks_and_ignore_unsealed_or_forged_messages(name, keyed):
    import msgpack

    from mooncake.registry import load_backend
    from mooncake.transfer.framing import binding, block_frames, pack_header, seal_for
    from tests.security.test_transport_seal import unanswered  # with the data plane's password: it meets the MAC
    from tests.transfer.test_transport_contract import DictService, available
    available(name)

    async def run():
        cls = load_backend("transports", name)
        service = DictService()
        server, client = cls(), cls()
        address = await server.start(service)
        await client.start()
        try:
            assert (await client.send(address, [(1, b"sealed" * 50)], timeout_s=10)).ok
            assert bytes(service.blocks[1]) == b"sealed" * 50
            keys, sizes, sums, frames = block_frames([(2, b"poison" * 50)])
            header = pack_header("put", "forged-1", keys=keys, sizes=sizes, sums=sums)
            other = pack_header("put", "forged-1", keys=[3], sizes=sizes, sums=sums)
            bind = binding(b"stranger", 1)
            assert await unanswered(address, [b"", bind, header, *frames])  # no MAC
            assert await unanswered(address, [b"\0" * security.MAC_BYTES, bind, header, *frames])  # a made-up one
            assert await unanswered(address, [seal_for(bind, address, other), bind, header, *frames])  # another's
            assert 2 not in service.blocks and 3 not in service.blocks and server.refused == 3
            assert msgpack.unpackb(header)["op"] == "put"
        finally:
            await client.stop()
            await server.stop()
    asyncio.run(run())

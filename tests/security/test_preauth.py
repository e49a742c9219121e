"""Authenticate before buffering (issue: a data port buffered up to 1 GiB per frame from anyone before
checking a seal; two partial frames held 512 MiB of a decode instance). A data socket's peer must present
the data plane's password (ZeroMQ PLAIN, derived from data.secret) in its handshake, which ZAP checks
before a frame of it is read: a peer without it is refused at the handshake, and its frames are never
received, so never buffered."""

import asyncio
import time

import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from mooncake import security
from mooncake.config import load_config
from mooncake.registry import load_backend
from tests.transfer.test_transport_contract import DictService, available


FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


@pytest.fixture
def keyed(tmp_path):
    directory = security.generate_keys(tmp_path / "keys")
    security.configure(load_config(None, {"security.keys_dir": str(directory)}))
    yield
    security.reset()


@pytest.mark.parametrize("password", [None, b"guessed"])
@pytest.mark.parametrize("name", ["tcp", "shm", "mooncake"])  # mooncake: its doorbells' socket
def test_a_peer_without_the_data_secret_is_refused_before_any_frame_is_read(name, password, keyed):
    available(name)

    async def run():
        service = DictService()
        server = load_backend("transports", name)()
        address = await server.start(service)
        monitor = server._server.get_monitor_socket(FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        stranger_ctx = zmq.Context()
        stranger = stranger_ctx.socket(zmq.DEALER)  # no password: what any host that reaches the port has
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.setsockopt(zmq.SNDTIMEO, 2000)
        if password is not None:
            stranger.plain_username, stranger.plain_password = security.DATA_USER, password
        stranger.connect(address)
        try:
            big = bytes(64 << 20)
            try:  # a frame as large as a KV block may be, and the start of another: nothing takes them
                stranger.send_multipart([b"", b"binding", b"header", big])
            except zmq.Again:
                pass  # refused before it could even queue
            events, deadline = [], time.monotonic() + 10
            while time.monotonic() < deadline and not any(e & FAILED for e in events):
                if monitor.poll(100):
                    events.append(recv_monitor_message(monitor)["event"])
                await asyncio.sleep(0)
            assert any(e & FAILED for e in events) and zmq.EVENT_HANDSHAKE_SUCCEEDED not in events, events
            await asyncio.sleep(0.2)
            assert server.refused == 0 and service.blocks == {}  # nothing of it reached the endpoint at all
            # a member (the password, and the MAC) is served as ever
            client = load_backend("transports", name)()
            await client.start()
            try:
                assert (await client.send(address, [(1, b"kv" * 100)], timeout_s=10)).ok
            finally:
                await client.stop()
        finally:
            stranger.close()
            stranger_ctx.term()
            server._server.disable_monitor()
            monitor.close()
            await server.stop()
    asyncio.run(run())

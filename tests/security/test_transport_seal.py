"""Every KV byte under the seal, and a seal good once, for one receiver (issue: the MAC sealed only a
message's header and every KV payload was sent SELF_CHECKED, so an on-path host replayed a captured put's
MAC and header with forged KV and the pool served it; sealed messages replayed anywhere, any time).

With the cluster's keys, a captured sealed message (a) sent again to its endpoint, (b) sent to another
endpoint, (c) sent with other KV bytes, or (d) sent late, is refused, and nothing reaches the service.
Over every transport whose messages cross a socket (tcp, shm, mooncake)."""

import asyncio
import random
import time

import msgpack
import pytest
import zmq
import zmq.asyncio

import backends.transports.tcp as tcp
from mooncake import security
from mooncake.config import load_config
from mooncake.errors import KVPayloadError
from mooncake.hashing import checksum
from mooncake.kv_payload import KVPayload
from mooncake.registry import load_backend
from mooncake.transfer.contract import TransferError
from mooncake.transfer.framing import CLOCK_SKEW_S, ReplayGuard, binding
from tests.transfer.test_transport_contract import DictService, available


@pytest.fixture
def keyed(tmp_path):
    security.generate_keys(tmp_path / "keys")
    security.configure(load_config(None, {"security.keys_dir": str(tmp_path / "keys")}))
    yield
    security.reset()


def _payload(block_hash: int, data: bytes) -> bytes:
    return KVPayload.of(block_hash, b"m", "uint8", (len(data),), None, data).to_bytes()


async def unanswered(address: str, frames: list[bytes]) -> bool:
    # NOTE: with the data plane's password: it travels in the clear, so an on-path host learns it
    raw = security.client(zmq.asyncio.Context.instance().socket(zmq.DEALER), curve=False)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(address)
    try:
        await raw.send_multipart(frames)
        return not await raw.poll(1000)
    finally:
        raw.close()


def _recording(monkeypatch, withhold: bool = False) -> list:
    """What the on-path host captures of each message a client sends; with `withhold`, it also keeps the
    messages from their receiver (to deliver them altered)."""
    captured = []
    real_send = tcp._send_frames

    def recording(sock, frames):
        if sock.type == zmq.DEALER:
            captured.append([bytes(memoryview(f)) for f in frames])
            if withhold:
                return
        real_send(sock, frames)
    monkeypatch.setattr(tcp, "_send_frames", recording)
    return captured


@pytest.mark.parametrize("name", ["tcp", "shm", "mooncake"])
def test_a_captured_sealed_message_is_good_once_for_its_receiver(name, keyed, monkeypatch):
    available(name)
    captured = _recording(monkeypatch)

    async def run():
        cls = load_backend("transports", name)
        service, other_service = DictService(), DictService()
        server, other, client = cls(), cls(), cls()
        address, other_address = await server.start(service), await other.start(other_service)
        await client.start()
        try:
            block = _payload(1, random.Random(1).randbytes(4096))
            assert (await client.send(address, [(1, block)], timeout_s=10, self_checked=True)).ok
            (message,) = [m for m in captured if b"put" in m[2]]
            service.blocks.clear()
            assert await unanswered(address, message)  # replayed to its endpoint
            assert await unanswered(other_address, message)  # sent to another endpoint
            assert service.blocks == {} and other_service.blocks == {}
            assert server.refused == 1 and other.refused == 1
            assert (await client.send(address, [(2, block)], timeout_s=10, self_checked=True)).ok  # it goes on
        finally:
            await client.stop()
            await other.stop()
            await server.stop()
    asyncio.run(run())


def test_forged_kv_delivered_under_a_withheld_genuine_seal_is_refused(keyed, monkeypatch):
    """The attack as it was run: the on-path host takes a sealed put off the wire and delivers its MAC,
    binding and header with KV of its own (a payload as self-consistent as the real one)."""
    captured = _recording(monkeypatch, withhold=True)

    async def run():
        cls = load_backend("transports", "tcp")
        service = DictService()
        server, client = cls(), cls()
        address = await server.start(service)
        await client.start()
        try:
            block = _payload(1, random.Random(1).randbytes(4096))
            with pytest.raises(TransferError):  # withheld: the genuine put never arrives
                await client.send(address, [(1, block)], timeout_s=0.5, self_checked=True)
            (message,) = captured
            forged = _payload(1, random.Random(2).randbytes(4096))
            reply = await _reply(address, message[:3] + [forged])
            header = msgpack.unpackb(reply[2])
            assert header["op"] == "put-reply" and "forged" in header["errors"][0]
            assert service.blocks == {}
        finally:
            await client.stop()
            await server.stop()
    asyncio.run(run())


async def _reply(address: str, frames: list[bytes]):
    # NOTE: with the data plane's password: it travels in the clear, so an on-path host learns it
    raw = security.client(zmq.asyncio.Context.instance().socket(zmq.DEALER), curve=False)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(address)
    try:
        await raw.send_multipart(frames)
        return await raw.recv_multipart() if await raw.poll(2000) else None
    finally:
        raw.close()


def test_the_replay_guard_admits_each_message_once_in_order_and_only_when_fresh():
    guard = ReplayGuard(window_s=60)
    a1, a2, b1 = binding(b"sender-a", 1), binding(b"sender-a", 2), binding(b"sender-b", 1)
    assert guard.admit(a1) is None and guard.admit(b1) is None and guard.admit(a2) is None
    assert guard.admit(a1) == "replayed" and guard.admit(a2) == "replayed"
    assert guard.admit(binding(b"sender-a", 3)) is None
    assert guard.admit(b"short") == "malformed binding"
    late = ReplayGuard(window_s=60, clock=lambda: 1e12)  # the receiver's clock, far past the binding's
    assert "replayed, or the clocks differ" in late.admit(binding(b"sender-c", 1))


def test_a_message_sealed_before_its_receiver_started_is_refused():
    """A receiver that restarts on the same address has forgotten what it admitted: whatever was sealed
    before it started (less the skew the hosts' clocks may have) cannot be new to it."""
    started = time.time()
    guard = ReplayGuard(window_s=3600, clock=lambda: started)
    assert "before this receiver started" in guard.admit(binding(b"sender-d", 1, at=started - CLOCK_SKEW_S - 1))
    assert guard.admit(binding(b"sender-d", 2, at=started - CLOCK_SKEW_S / 2)) is None  # a sender's clock behind
    assert guard.admit(binding(b"sender-d", 3, at=started + 5)) is None


@pytest.mark.parametrize("name", ["tcp", "shm"])
def test_a_message_captured_before_its_receiver_restarted_is_refused_after(name, keyed, monkeypatch):
    captured = _recording(monkeypatch)

    async def run():
        cls = load_backend("transports", name)
        service = DictService()
        server, client = cls(), cls()
        address = await server.start(service)
        await client.start()
        try:
            block = _payload(1, random.Random(1).randbytes(4096))
            assert (await client.send(address, [(1, block)], timeout_s=10, self_checked=True)).ok
            (message,) = [m for m in captured if b"put" in m[2]]
            await server.stop()
            await asyncio.sleep(CLOCK_SKEW_S + 0.2)  # a restart takes longer than the clocks may differ
            server = cls()
            assert await server.start(service, address=address) == address
            service.blocks.clear()
            assert await unanswered(address, message)  # the new process never saw it, yet refuses it
            assert service.blocks == {} and server.refused == 1
            assert (await client.send(address, [(2, block)], timeout_s=10, self_checked=True)).ok
        finally:
            await client.stop()
            await server.stop()
    asyncio.run(run())


def test_kv_bytes_or_a_payload_made_without_the_cluster_key_fail_their_consumers_check(keyed, tmp_path):
    """Every KV byte is under the cluster's key wherever it comes from (a transport, the pool, SSD): other
    bytes under a genuine payload's header fail its MAC, and a payload made without the key (as an
    attacker can make one as self-consistent as a real one) fails its header's keyed digest."""
    data = random.Random(1).randbytes(4096)
    genuine = KVPayload.of(1, b"m", "uint8", (len(data),), None, data).to_bytes()
    KVPayload.from_bytes(genuine).verify(namespace=b"m")
    forged = genuine[:-len(data)] + random.Random(2).randbytes(len(data))
    with pytest.raises(KVPayloadError, match="fail their MAC"):
        KVPayload.from_bytes(forged).verify(namespace=b"m")
    security.generate_keys(tmp_path / "other")  # another cluster's key, or none at all: the same to us
    for keys in (str(tmp_path / "other"), ""):
        security.configure(load_config(None, {"security.keys_dir": keys}))
        outsider = KVPayload.of(1, b"m", "uint8", (len(data),), None, data).to_bytes()
        security.configure(load_config(None, {"security.keys_dir": str(tmp_path / "keys")}))
        with pytest.raises(KVPayloadError, match="header fails its check"):
            KVPayload.from_bytes(outsider)

"""One contract suite run over every transport backend."""

import asyncio
import os
import random
import socket
import time

import msgpack
import pytest
import zmq
import zmq.asyncio

from mooncake import hashing
from mooncake.registry import load_backend
from mooncake.hashing import checksum
from mooncake.kv_payload import KVPayload, bound_digest
from mooncake.transfer.contract import SELF_CHECKED, BlockService, TransferError
from mooncake.transfer.framing import WIRE_VERSION, binding
from tests.transfer.conftest import KeepingService

BACKENDS = ["inproc", "tcp", "shm", "mooncake"]


def available(name):
    """Skip the `mooncake` transport where its Transfer Engine is not installed (CI requires it)."""
    from mooncake.errors import BackendError
    try:
        load_backend("transports", name)
        if name == "mooncake":
            from backends.transports.mooncake_te import load_transfer_engine
            load_transfer_engine()
    except BackendError as exc:
        if os.environ.get("MOONCAKE_REQUIRE_ALL_BACKENDS"):
            raise
        pytest.skip(str(exc))


class DictService(BlockService):
    """Declares no optional capability; records the checksum each put was handed."""

    def __init__(self):
        self.blocks, self.sums = {}, {}

    def put_block(self, key, data, checksum=None):
        self.blocks.setdefault(key, bytes(data))
        self.sums[key] = checksum
        return None

    def get_block(self, key):
        return self.blocks.get(key)


def flip_byte_of(*target_keys):
    def tamper(key, data):
        if key not in target_keys:
            return data
        raw = bytearray(data)
        raw[len(raw) // 2] ^= 0x01
        return bytes(raw)
    return tamper


async def pair(name, client_tamper=None, server_tamper=None, service=None):
    available(name)
    cls = load_backend("transports", name)
    server, client = cls(tamper=server_tamper), cls(tamper=client_tamper)
    service = service or DictService()
    address = await server.start(service)
    await client.start()
    return server, client, service, address


def payloads():
    rng = random.Random(1)
    return [(k, rng.randbytes(size)) for k, size in enumerate([1, 4096, 1 << 20, 3 * (1 << 20) + 7])]


@pytest.mark.parametrize("name", BACKENDS)
def test_random_payloads_round_trip_bit_exact(name):
    async def run():
        server, client, service, address = await pair(name)
        try:
            blocks = payloads()
            sent = await client.send(address, blocks, timeout_s=10)
            assert sent.ok and sent.num_bytes == sum(len(d) for _, d in blocks) and sent.seconds > 0
            assert all(service.blocks[k] == d for k, d in blocks)
            assert all(service.sums[k] == checksum(d) for k, d in blocks)  # the sum it verified, handed on
            got = await client.fetch(address, [k for k, _ in blocks] + [99], timeout_s=10)
            assert [bytes(b.data) for b in got.blocks[:-1]] == [d for _, d in blocks]
            assert got.blocks[-1].error == "not found" and got.blocks[-1].data is None
        finally:
            await client.stop()
            await server.stop()
    asyncio.run(run())


@pytest.mark.parametrize("name", BACKENDS)
def test_flipped_byte_is_reported_per_block_never_returned(name):
    async def run():
        server, client, service, address = await pair(name, client_tamper=flip_byte_of(2),
                                                      server_tamper=flip_byte_of(1, 3))
        try:
            blocks = payloads()
            sent = await client.send(address, blocks, timeout_s=10)
            assert [b.ok for b in sent.blocks] == [True, True, False, True]
            assert "checksum" in sent.blocks[2].error and 2 not in service.blocks
            got = await client.fetch(address, [0, 1, 3], timeout_s=10)  # 3 is large: hashed as it is copied
            assert [b.ok for b in got.blocks] == [True, False, False]
            assert all(b.data is None and "checksum" in b.error for b in got.blocks[1:])
        finally:
            await client.stop()
            await server.stop()
    asyncio.run(run())


@pytest.mark.parametrize("name", BACKENDS)
def test_a_self_checked_block_is_neither_hashed_nor_verified_in_transit(name, monkeypatch):
    """A block that carries its own check (a KV payload) crosses without a hash on either side, under its
    bound digest (read from the payload's header); a byte flipped in its data reaches the service as it
    is, for the consumer's own check to catch (tests/test_kv_payload.py, tests/store/test_store_service.py)."""
    async def run():
        server, client, service, address = await pair(name, client_tamper=flip_byte_of(2))
        try:
            blocks = payloads()
            hashed = []
            real = hashing._xxh3
            monkeypatch.setattr(hashing, "_xxh3", lambda data: hashed.append(len(data)) or real(data))
            sent = await client.send(address, blocks, timeout_s=10, self_checked=True)
            assert sent.ok and hashed == []
            assert all(service.sums[k] == bound_digest(d) for k, d in blocks)
            assert [service.blocks[k] == d for k, d in blocks] == [True, True, False, True]
            plain = await client.send(address, [(9, blocks[1][1])], timeout_s=10)  # no flag: hashed as ever
            assert plain.ok and hashed and service.sums[9] == checksum(blocks[1][1])
        finally:
            await client.stop()
            await server.stop()
    asyncio.run(run())


def kv_payload(block_hash: int, data: bytes) -> bytes:
    return KVPayload.of(block_hash, b"m", "uint8", (len(data),), None, data).to_bytes()


@pytest.mark.parametrize("name", BACKENDS)
def test_forged_kv_under_a_genuine_seal_is_refused(name):
    """The attack: an on-path host keeps a sealed put's MAC and header and swaps in KV of its own, a
    payload as consistent as the real one (its own header and checksum). The header's bound digest names
    the real payload, so the forged one is refused on the way in, and never reaches the service."""
    rng = random.Random(5)
    real = [(k, kv_payload(k, rng.randbytes(size))) for k, size in enumerate([4096, 1 << 20])]
    forged = {k: kv_payload(k, rng.randbytes(len(KVPayload.from_bytes(d).data))) for k, d in real}
    assert all(len(forged[k]) == len(d) for k, d in real)

    async def run():
        server, client, service, address = await pair(name, client_tamper=lambda key, data: forged[key])
        try:
            sent = await client.send(address, real, timeout_s=10, self_checked=True)
            assert not any(b.ok for b in sent.blocks) and all("forged" in b.error for b in sent.blocks)
            assert service.blocks == {}
        finally:
            await client.stop()
            await server.stop()
    asyncio.run(run())


def test_a_header_that_binds_no_bytes_is_refused():
    """SELF_CHECKED (what payloads were sent under before) binds nothing to the seal: every receiver's
    check refuses it (tcp, shm and mooncake verify with `verify_blocks`; write windows with `digest_of`)."""
    from mooncake.transfer.framing import verify_blocks
    block = kv_payload(3, b"kv" * 100)
    (refused, bound) = verify_blocks([3, 3], [SELF_CHECKED, bound_digest(block)], [block, block])
    assert not refused.ok and "unbound" in refused.error and bound.ok


def small_payloads():
    """Many small blocks in one transfer (layer slices of a small model)."""
    rng = random.Random(2)
    return [(100 + k, rng.randbytes(size)) for k, size in enumerate([1, 2, 24576, 65535] + [24576] * 28)]


@pytest.mark.parametrize("name", BACKENDS)
def test_many_small_blocks_round_trip_each_as_its_own_bytes_and_a_flipped_one_is_caught(name):
    async def run():
        blocks = small_payloads()
        server, client, service, address = await pair(name, client_tamper=flip_byte_of(103),
                                                      service=KeepingService())
        try:
            sent = await client.send(address, blocks, timeout_s=10)
            assert [b.key for b in sent.blocks if not b.ok] == [103]
            assert "checksum" in next(b.error for b in sent.blocks if not b.ok)
            assert all(bytes(service.blocks[k]) == d for k, d in blocks if k != 103) and 103 not in service.blocks
            got = await client.fetch(address, [k for k, _ in blocks], timeout_s=10)
            assert [bytes(b.data) for b in got.blocks if b.ok] == [d for k, d in blocks if k != 103]
            again = await client.send(address, [(k + 1000, os.urandom(len(d))) for k, d in blocks], timeout_s=10,
                                      self_checked=True)
            assert again.ok  # and what the service kept of the first put is unchanged by the second
            assert all(bytes(service.blocks[k]) == d for k, d in blocks if k != 103)
        finally:
            await client.stop()
            await server.stop()
    asyncio.run(run())


def dead_address(name):
    if name == "inproc":
        return "inproc://nobody"
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("name", BACKENDS)
def test_dead_peer_is_a_clear_error_within_the_deadline(name):
    available(name)

    async def run():
        client = load_backend("transports", name)()
        await client.start()
        peer = dead_address(name)
        try:
            for call in (client.send(peer, [(1, b"x")], timeout_s=0.5, request_id="req-42"),
                         client.fetch(peer, [1], timeout_s=0.5, request_id="req-42")):
                t0 = time.monotonic()
                with pytest.raises(TransferError, match=f"req-42.*{peer}|{peer}.*req-42|req-42 .*{peer}"):
                    await call
                assert time.monotonic() - t0 < 2.0
        finally:
            await client.stop()
    asyncio.run(run())


async def raw_reply(address: str, frames: list[bytes]) -> dict:
    """Send `frames` from a bare DEALER socket, as a foreign peer would (with the empty MAC of a cluster
    without keys, and a binding of its own), and decode the reply header."""
    raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    raw.connect(address)
    try:
        await raw.send_multipart([b"", binding(os.urandom(8), 1), *frames])
        _mac, _binding, header, *_ = await asyncio.wait_for(raw.recv_multipart(), 5)
        return msgpack.unpackb(header)
    finally:
        raw.close(linger=0)


def test_tcp_malformed_message_gets_an_error_reply_and_serving_goes_on():
    async def run():
        server, client, service, address = await pair("tcp")
        try:
            reply = await raw_reply(address, [b"\x93garbage"])
            assert reply["op"] == "error" and "malformed" in reply["error"]
            sent = await client.send(address, [(5, b"still serving")], timeout_s=5)
            assert sent.ok and service.blocks[5] == b"still serving"
        finally:
            await client.stop()
            await server.stop()
    asyncio.run(run())


def test_a_peer_of_another_wire_version_gets_an_error_naming_both_versions():
    async def run():
        server, client, service, address = await pair("tcp")
        try:  # a version-1 peer: its checksums of large blocks would never match ours
            old_put = msgpack.packb({"v": 1, "op": "put", "id": "old-1", "keys": [7], "sums": [0], "sizes": [1]})
            reply = await raw_reply(address, [old_put, b"x"])
            assert reply["op"] == "error" and reply["id"] == "old-1"
            assert f"wire version 1; this build speaks {WIRE_VERSION}" in reply["error"] and 7 not in service.blocks
        finally:
            await client.stop()
            await server.stop()
    asyncio.run(run())


def test_unknown_transport_is_a_clear_error():
    from mooncake.errors import BackendError
    with pytest.raises(BackendError, match="unknown transports backend 'rdma9'"):
        load_backend("transports", "rdma9")


def test_shm_leaves_no_shared_memory_files_behind():
    from backends.transports.shm import SHM_DIR

    def ours():
        return {p.name for p in SHM_DIR.glob(f"mooncake-shm-{os.getpid()}-*")}

    async def run():
        server, client, service, address = await pair("shm")
        try:
            await client.send(address, payloads(), timeout_s=10)
            await client.fetch(address, [0, 1, 2, 3], timeout_s=10)
        finally:
            await client.stop()
            await server.stop()
    asyncio.run(run())
    assert ours() == set()


def test_tcp_address_in_use_is_a_clear_error():
    async def run():
        first = load_backend("transports", "tcp")()
        address = await first.start(DictService())
        second = load_backend("transports", "tcp")()
        try:
            with pytest.raises(TransferError, match=f"cannot listen on {address}"):
                await second.start(DictService(), address)
        finally:
            await second.stop()
            await first.stop()
    asyncio.run(run())


@pytest.mark.parametrize("name", BACKENDS)
def test_concurrent_transfers_to_one_peer_all_complete(name):
    """Prefill pushes a request's chunks while earlier chunks are still in flight."""
    async def run():
        server, client, service, address = await pair(name)
        try:
            batches = [[(10 * i + k, os.urandom(256 << 10)) for k in range(3)] for i in range(4)]
            results = await asyncio.gather(*(client.send(address, b, timeout_s=10, request_id=f"req/{i}")
                                             for i, b in enumerate(batches)))
            assert all(r.ok for r in results)
            assert all(service.blocks[k] == d for b in batches for k, d in b)
        finally:
            await client.stop()
            await server.stop()
    asyncio.run(run())


@pytest.mark.parametrize("name", ["tcp", "shm"])
def test_a_transfer_id_already_in_flight_is_refused_not_left_hanging(name):
    async def run():
        server, client, service, address = await pair(name)
        try:
            first = asyncio.create_task(client.send(address, [(1, os.urandom(4 << 20))], 10, request_id="same"))
            await asyncio.sleep(0)  # let the first one register its id
            with pytest.raises(TransferError, match="same.*already in flight"):
                await client.send(address, [(2, b"y")], 10, request_id="same")
            assert (await first).ok
        finally:
            await client.stop()
            await server.stop()
    asyncio.run(run())


def test_request_ids_are_unique_within_a_process_and_differ_in_a_forked_child():
    from mooncake.transfer.contract import new_request_id
    ids = {new_request_id() for _ in range(10_000)}
    assert len(ids) == 10_000
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports its first id and leaves at once
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.close(write)
    child_id = os.read(read, 64).decode()
    os.waitpid(pid, 0)
    parent_id = new_request_id()
    assert child_id and child_id not in ids and child_id[:10] != parent_id[:10]


@pytest.mark.parametrize("name", BACKENDS)
def test_a_service_that_keeps_blocks_gets_bytes_that_outlive_the_transports_buffers(name):
    async def run():
        server, client, service, address = await pair(name, service=KeepingService())
        try:
            first, second = payloads(), [(k + 10, os.urandom(len(d))) for k, d in payloads()]
            for batch in (first, second):  # the second reuses the sender's staging, or the receiver's
                sent = await client.send(address, batch, timeout_s=10)
                assert sent.ok
            assert [bytes(service.blocks[k]) for k, _ in first + second] == [d for _, d in first + second]
        finally:
            await client.stop()
            await server.stop()
    asyncio.run(run())


@pytest.mark.parametrize("name", ["shm", "mooncake"])
def test_a_staged_fetch_reply_is_released_once_read(name):
    async def run():
        server, client, service, address = await pair(name)
        try:
            blocks = payloads()
            assert (await client.send(address, blocks, timeout_s=10)).ok
            assert (await client.fetch(address, [k for k, _ in blocks], timeout_s=10)).ok
            deadline = time.monotonic() + 5  # the reader's release notice frees the staged reply
            while server.arena.largest_free_extent() < len(server.buffer):
                assert time.monotonic() < deadline, "the staged fetch reply was never released"
                await asyncio.sleep(0.01)
        finally:
            await client.stop()
            await server.stop()
    asyncio.run(run())

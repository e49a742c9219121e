"""The cache role's BlockService over the transports: checksums verified on the way in are reused on the
way out, and over shm a reader copies blocks straight out of the store's shared DRAM tier."""

import asyncio
import os

import numpy as np
import pytest

from mooncake import hashing
from mooncake.config import StoreConfig
from mooncake.errors import KVPayloadError
from mooncake.hashing import checksum
from mooncake.kv_payload import KVPayload, bound_digest
from mooncake.registry import load_backend
from mooncake.store.server import StoreService
from mooncake.store.store import KVStore


async def serve(transport_name: str, shared: bool):
    store = KVStore(StoreConfig(dram_bytes=64 << 20), shared_dram=shared)
    cls = load_backend("transports", transport_name)
    server, client = cls(), cls()
    address = await server.start(StoreService(store, read_lease_s=5.0))
    await client.start()
    return store, server, client, address


@pytest.mark.parametrize("name, shared", [("tcp", False), ("shm", True), ("shm", False)])
def test_blocks_round_trip_and_are_hashed_once_on_the_node(name, shared, monkeypatch):
    async def run():
        store, server, client, address = await serve(name, shared)
        try:
            blocks = [(k, os.urandom(size)) for k, size in enumerate([1, 4096, 3 << 20])]
            assert (await client.send(address, blocks, timeout_s=10)).ok
            assert store._sums == {k: checksum(d) for k, d in blocks}  # remembered from the put
            calls = []
            monkeypatch.setattr("mooncake.store.store.checksum", lambda data: calls.append(1) or 0)
            got = await client.fetch(address, [0, 1, 2, 9], timeout_s=10)
            assert [bytes(b.data) for b in got.blocks[:3]] == [d for _, d in blocks]
            assert got.blocks[3].error == "not found" and calls == []  # no re-hash on the node
        finally:
            await client.stop()
            await server.stop()
            store.close()
    asyncio.run(run())


@pytest.mark.parametrize("name, shared", [("tcp", False), ("shm", True), ("shm", False)])
def test_a_kv_payload_crosses_the_pool_unhashed_and_its_consumer_catches_corruption(name, shared, monkeypatch):
    """One check from export to import: a payload put `self_checked` is hashed by no transport and not by
    the node, on the way in or out; a byte flipped while it sat in the pool reaches the reader, whose
    KVPayload check refuses it."""
    async def run():
        store, server, client, address = await serve(name, shared)
        try:
            data = os.urandom(1 << 20)
            wire = KVPayload.of(7, b"m", "uint8", (len(data),), None, data).to_bytes()
            hashed = []
            real = hashing._xxh3
            monkeypatch.setattr(hashing, "_xxh3", lambda buf: hashed.append(len(buf)) or real(buf))
            assert (await client.send(address, [(7, wire)], timeout_s=10, self_checked=True)).ok
            got = await client.fetch(address, [7], timeout_s=10)
            assert got.ok and bytes(got.blocks[0].data) == wire and hashed == []
            assert store._sums == {7: bound_digest(wire)}
            monkeypatch.undo()
            KVPayload.from_bytes(got.blocks[0].data).verify(namespace=b"m")  # the one check
            lease = store.get(7, lease_s=1.0)
            np.frombuffer(lease.data, dtype=np.uint8)[len(wire) - 100] ^= 0xFF  # corrupted where it sits
            bad = await client.fetch(address, [7], timeout_s=10)
            assert bad.ok  # no transport check on the way out either...
            with pytest.raises(KVPayloadError, match="fail their MAC"):  # ...the consumer's catches it
                KVPayload.from_bytes(bad.blocks[0].data).verify(namespace=b"m")
        finally:
            await client.stop()
            await server.stop()
            store.close()
    asyncio.run(run())


def test_over_shm_a_reader_copies_from_the_store_and_corruption_there_is_caught():
    async def run():
        store, server, client, address = await serve("shm", True)
        try:
            data = os.urandom(1 << 20)
            assert (await client.send(address, [(7, data)], timeout_s=10)).ok
            path, offset, size = store.dram_location(7)
            assert os.path.exists(path) and size == len(data)
            got = await client.fetch(address, [7], timeout_s=10)
            assert got.ok and bytes(got.blocks[0].data) == data
            assert server.arena.largest_free_extent() == server.arena.capacity_bytes  # nothing staged
            store.tiers[0]._view[offset + 100] ^= 0xFF  # memory corruption in the store
            bad = await client.fetch(address, [7], timeout_s=10)
            assert not bad.ok and "checksum" in bad.blocks[0].error and bad.blocks[0].data is None
        finally:
            await client.stop()
            await server.stop()
            store.close()
        assert not os.path.exists(path)  # the shared DRAM file goes with the store
    asyncio.run(run())


def test_over_shm_a_put_is_written_in_place_in_the_store_and_verified_there():
    async def run():
        store, server, client, address = await serve("shm", True)
        service = server.service
        try:
            blocks = [(k, os.urandom(3 << 20)) for k in range(6)]  # windows of 2 MiB, or one block's worth
            for block in blocks:
                assert (await client.send(address, [block], timeout_s=10)).ok
            assert len(service.windows) == 1  # a full window is closed when the next one opens
            for key, data in blocks:
                assert bytes(store.get(key).data) == data
            # Neither side staged anything: the sender wrote straight into the store's DRAM tier.
            for endpoint in (server, client):
                assert endpoint.arena.largest_free_extent() == endpoint.arena.capacity_bytes
            assert server.served["put"]["requests"] == 6

            service.windows.close_all()  # as after a node restart: the sender's window is unknown
            assert (await client.send(address, [(50, b"after")], timeout_s=10)).ok
            assert bytes(store.get(50).data) == b"after"
            await client.stop()  # hands its window back
            for _ in range(200):
                if not len(service.windows):
                    break
                await asyncio.sleep(0.01)
            assert store.tiers[0].used_bytes == sum(len(d) for _, d in blocks) + 5
        finally:
            await client.stop()
            await server.stop()
            store.close()
    asyncio.run(run())


def test_a_block_corrupted_on_its_way_into_a_window_is_refused():
    async def run():
        store = KVStore(StoreConfig(dram_bytes=64 << 20), shared_dram=True)
        server = load_backend("transports", "shm")()
        client = load_backend("transports", "shm")(tamper=lambda key, data: data[:-1] + bytes([data[-1] ^ 1])
                                                    if key == 2 else data)
        address = await server.start(StoreService(store, read_lease_s=5.0))
        await client.start()
        try:
            result = await client.send(address, [(1, os.urandom(4096)), (2, os.urandom(4096))], timeout_s=10)
            assert result.blocks[0].ok and "checksum" in result.blocks[1].error
            assert store.exists(1) == "dram" and store.exists(2) is None
        finally:
            await client.stop()
            await server.stop()
            store.close()
    asyncio.run(run())


def test_a_sender_stops_writing_into_a_window_before_the_node_may_take_it_back():
    async def run():
        store, server, client, address = await serve("shm", True)
        server.service.windows.ttl_s = 2.3  # the sender keeps a 2 s margin: usable for 0.3 s
        try:
            assert (await client.send(address, [(1, b"a" * 4096)], timeout_s=10)).ok
            first = set(server.service.windows._windows)
            assert (await client.send(address, [(2, b"b" * 4096)], timeout_s=10)).ok
            assert set(server.service.windows._windows) == first  # still fresh: same window
            await asyncio.sleep(0.4)
            assert (await client.send(address, [(3, b"c" * 4096)], timeout_s=10)).ok
            assert set(server.service.windows._windows).isdisjoint(first)  # a new one; the old one closed
            assert [bytes(store.get(k).data) for k in (1, 2, 3)] == [b"a" * 4096, b"b" * 4096, b"c" * 4096]
        finally:
            await client.stop()
            await server.stop()
            store.close()
    asyncio.run(run())


def test_a_sender_unmaps_the_dram_of_a_node_that_is_gone():
    async def run():
        old, old_server, client, old_address = await serve("shm", True)
        new = KVStore(StoreConfig(dram_bytes=64 << 20), shared_dram=True)
        new_server = load_backend("transports", "shm")()
        new_address = await new_server.start(StoreService(new, read_lease_s=5.0))
        try:
            assert (await client.send(old_address, [(1, b"x" * 4096)], timeout_s=10)).ok
            assert (await client.fetch(old_address, [1], timeout_s=10)).ok
            old_path = old.dram_location(1)[0]
            mappings = [m for (path, _), m in client._peer_maps.items() if path == old_path]
            assert len(mappings) == 2  # read-only for gets, writable for the window
            await old_server.stop()
            old.close()  # the node is gone, and its DRAM file with it
            assert (await client.send(new_address, [(2, b"y" * 4096)], timeout_s=10)).ok
            assert {path for path, _ in client._peer_maps} == {new.dram_location(2)[0]}
            assert all(m.closed for m in mappings) and old_address not in client._windows
        finally:
            await client.stop()
            await new_server.stop()
            new.close()
    asyncio.run(run())

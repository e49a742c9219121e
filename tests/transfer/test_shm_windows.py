"""The shm transport's own segment as a write-window lender, for a service that keeps what it is given
(the decode inbox): one copy per block, and every range comes back once the service lets go."""

import asyncio
import gc
import os

import numpy as np
import pytest

from backends.transports.shm import ShmTransport
from tests.transfer.conftest import KeepingService

MiB = 1 << 20


def in_segment(data, transport) -> bool:
    """Whether `data` lies inside the transport's own segment (written there by the sender)."""
    start = transport.buffer.__array_interface__["data"][0]
    at = np.frombuffer(data, dtype=np.uint8).__array_interface__["data"][0]
    return start <= at < start + len(transport.buffer)


async def until(condition, timeout_s=5.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_a_keeping_service_gets_blocks_where_the_sender_wrote_them_and_their_ranges_come_back():
    async def run():
        server, client, service = ShmTransport(), ShmTransport(), KeepingService()
        address = await server.start(service)
        await client.start()
        try:
            blocks = [(1, os.urandom(4096)), (2, os.urandom(MiB)), (3, os.urandom(3 * MiB + 5))]
            assert (await client.send(address, blocks, timeout_s=10)).ok
            assert (await client.send(address, [(2, os.urandom(MiB))], timeout_s=10)).ok  # held: a no-op
            assert {k: bytes(d) for k, d in service.blocks.items()} == dict(blocks)
            assert all(in_segment(d, server) for d in service.blocks.values())  # no receive copy
            assert len(server._lender.windows) == 1
            await client.stop()  # hands its window back
            await until(lambda: len(server._lender.windows) == 0)
            service.blocks.clear()  # the service lets go: the ranges return to the arena
            gc.collect()
            server._free_let_go()
            assert server.arena.largest_free_extent() == len(server.buffer)
        finally:
            await server.stop()
    asyncio.run(run())


def test_when_kept_blocks_fill_the_segment_puts_fall_back_to_the_staged_path():
    async def run():
        server, client = ShmTransport(segment_bytes=16 * MiB), ShmTransport()
        service = KeepingService()
        address = await server.start(service)
        await client.start()
        try:
            blocks = [(k, os.urandom(2 * MiB)) for k in range(10)]  # 20 MiB kept: more than the segment
            for block in blocks:
                assert (await client.send(address, [block], timeout_s=10)).ok
            assert {k: bytes(d) for k, d in service.blocks.items()} == dict(blocks)
            placed = [in_segment(d, server) for d in service.blocks.values()]
            assert placed[0] and not placed[-1]  # lent while a quarter stayed free, then private copies
        finally:
            await client.stop()
            await server.stop()
    asyncio.run(run())


def test_blocks_a_service_still_holds_stay_readable_after_its_transport_stops():
    async def run():
        server, client, service = ShmTransport(), ShmTransport(), KeepingService()
        address = await server.start(service)
        await client.start()
        block = os.urandom(3 * MiB)
        assert (await client.send(address, [(1, block)], timeout_s=10)).ok
        assert in_segment(service.blocks[1], server)
        await client.stop()
        await server.stop()  # its segment file is gone; the mapping stays while a view of it lives
        assert not server.path.exists()
        assert bytes(service.blocks[1]) == block
    asyncio.run(run())


def test_a_locator_from_another_host_is_refused_naming_the_transports_to_use():
    from backends.transports.shm import BOOT_ID, check_same_host
    from mooncake.transfer.contract import TransferError
    assert BOOT_ID  # every shm locator and window reply carries it
    check_same_host({"boot": BOOT_ID}, "tcp://198.18.0.12:7800")
    with pytest.raises(TransferError, match=r"peer tcp://198.18.0.12:7800 runs on another host.*tcp or mooncake"):
        check_same_host({"boot": "another-kernel"}, "tcp://198.18.0.12:7800")

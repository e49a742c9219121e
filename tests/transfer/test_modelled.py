"""The modelled network (mooncake/transfer/modelled.py): an emulated instance's transfers take what the
network it models would, by what each payload is (a KV block, a layer's slice of one, hidden states of
so many tokens), before a send and after a fetch, within the caller's deadline; other bytes cost nothing."""

import asyncio
import time

import torch

from mooncake.hidden_payload import encode_hidden
from mooncake.kv_payload import KVPayload
from mooncake.registry import load_backend
from mooncake.transfer.contract import BlockService
from mooncake.transfer.modelled import ModelledNetwork

PER_BLOCK, LAYERS, PER_TOKEN = 0.4, 4, 0.01


def _kv(layer):
    shape = (2, 2, 1, 2) if layer is not None else (LAYERS, 2, 2, 1, 2)
    return KVPayload.of(7, b"ns", "float32", shape, layer, bytes(4 * int(torch.tensor(shape).prod()))).to_bytes()


class Store(BlockService):
    """A block service that keeps what it is given."""

    def __init__(self):
        self.blocks = {}

    def put_block(self, key, data, checksum=None):
        self.blocks[key] = bytes(data)
        return None

    def get_block(self, key):
        return self.blocks.get(key)


def test_each_payload_costs_its_modelled_transfer():
    network = ModelledNetwork(load_backend("transports", "inproc")(), PER_BLOCK, LAYERS, PER_TOKEN)
    assert network.modelled_s([_kv(None)]) == PER_BLOCK
    assert network.modelled_s([_kv(1), _kv(2)]) == 2 * PER_BLOCK / LAYERS
    assert abs(network.modelled_s([encode_hidden(torch.zeros(30, 5))]) - 30 * PER_TOKEN) < 1e-12
    assert network.modelled_s([b"not a payload at all", b""]) == 0.0


def test_a_send_waits_before_and_a_fetch_after_within_the_callers_deadline():
    async def main():
        store, inner = Store(), load_backend("transports", "inproc")()
        server = load_backend("transports", "inproc")()
        address = await server.start(store)
        network = ModelledNetwork(inner, PER_BLOCK, LAYERS, PER_TOKEN)
        await network.start()
        try:
            started = time.monotonic()
            sent = await network.send(address, [(1, _kv(None))], timeout_s=5.0, self_checked=True)
            assert sent.ok and time.monotonic() - started >= PER_BLOCK
            started = time.monotonic()
            fetched = await network.fetch(address, [1, 2], timeout_s=5.0)
            assert time.monotonic() - started >= PER_BLOCK  # the one block found, not the missing one
            assert fetched.blocks[0].ok and not fetched.blocks[1].ok
        finally:
            await network.stop()
            await server.stop()
    asyncio.run(main())

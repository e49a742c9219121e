"""A transport whose network is modelled: the one place an emulated model's transfers take the time the
hardware it emulates would.

An emulated model's KV and hidden states are far smaller than those of the model it stands for
(backends/models/emulated.py), so moving them costs, beyond moving the real bytes, what the modelled
network would take for the modelled ones: per KV block (a layer's slice counts 1/layers of one) and per
token of hidden states, as the runner's `modelled.transfer_seconds` and `activation_seconds` say (the simulator
charges the same, mooncake/cost.py). `ModelledNetwork` wraps any transport and waits that out: before a
send, after a fetch. An instance whose runner emulates wraps its transports in it (its roles then wait out
no time of their own); one with a real model never does."""

import asyncio
import time

import msgpack

from mooncake.kv_payload import PREFIX as _PREFIX  # both payload formats begin so: header length, its digest
from mooncake.transfer.contract import BlockService, TransferResult, Transport


class ModelledNetwork(Transport):
    def __init__(self, inner: Transport, s_per_block: float, num_layers: int, s_per_token: float):
        self.inner = inner
        self.name = inner.name
        self.s_per_block, self.num_layers, self.s_per_token = s_per_block, num_layers, s_per_token

    @property
    def served(self):
        return self.inner.served

    async def start(self, service: BlockService | None = None, address: str | None = None) -> str:
        return await self.inner.start(service, address)

    async def stop(self) -> None:
        await self.inner.stop()

    async def send(self, peer: str, blocks: list[tuple[int, bytes | memoryview]], timeout_s: float,
                   request_id: str | None = None, self_checked: bool = False) -> TransferResult:
        started = time.monotonic()
        if delay := self.modelled_s(data for _, data in blocks):
            await asyncio.sleep(delay)
        left = max(0.01, timeout_s - (time.monotonic() - started))
        return await self.inner.send(peer, blocks, left, request_id, self_checked)

    async def fetch(self, peer: str, keys: list[int], timeout_s: float,
                    request_id: str | None = None) -> TransferResult:
        result = await self.inner.fetch(peer, keys, timeout_s, request_id)
        if delay := self.modelled_s(b.data for b in result.blocks if b.ok and b.data is not None):
            await asyncio.sleep(delay)
        return result

    def modelled_s(self, payloads) -> float:
        """What the modelled network takes for these encoded payloads: KV payloads (kv_payload.py) by the
        block, hidden states (hidden_payload.py) by the token; anything else (not a payload) costs nothing
        beyond its real bytes."""
        total = 0.0
        for data in payloads:
            header = _header(data)
            if header is None:
                continue
            if "layer" in header:  # a KV payload: a whole block, or one layer's slice of one
                total += self.s_per_block / (1 if header["layer"] is None else self.num_layers)
            elif header.get("shape"):  # hidden states: [tokens, ...]
                total += self.s_per_token * header["shape"][0]
        return total


def _header(data) -> dict | None:
    """A payload's msgpack header (not checked: its consumer checks it), None if it has none."""
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX.size:
        return None
    length, _ = _PREFIX.unpack_from(view)
    try:
        header = msgpack.unpackb(view[_PREFIX.size:_PREFIX.size + length])
    except (ValueError, msgpack.UnpackException):
        return None
    return header if isinstance(header, dict) else None

"""How CPP stages on different instances hand a prompt's activations on (DESIGN section 6), over the
configured transport.

Each stage's transport serves a `StageInbox`. A chunk's hidden states (`hidden_payload.py:encode_hidden`,
which carries its own check) are sent to the next stage's inbox under `chunk_key(request, stage, chunk)`,
self-checked, so no transport hashes them again; the receiving stage waits for that key with a deadline,
and `decode_hidden` verifies them. `run_stage` is one stage's whole part in a prompt: it receives chunk j,
computes it in its engine's steps (`compute`), starts sending the result on, and takes chunk j + 1, so a
stage computes while its neighbours send and compute."""

import asyncio
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import torch
import xxhash

from mooncake.hidden_payload import decode_hidden, encode_hidden
from mooncake.hashing import HASH_SEED
from mooncake.transfer.contract import BlockService, TransferError, Transport

# (stage, request id, tokens, hidden, since) -> `stage.run`'s result, computed in the stage engine's steps:
# EngineLoop.run_stage_chunk
Compute = Callable[..., Awaitable]


class Stage(Protocol):
    """What a stage run needs of an engine's pipeline stage (`engine/stage.py:PipelineStage`, which a role
    gets from `EngineLoop.pipeline_stage`); its chunks are computed through `compute`."""

    def begin(self, request_id: str, prompt_token_ids: list[int]) -> None: ...

    def run(self, request_id: str, num_tokens: int, hidden: torch.Tensor | None, since: float | None = None): ...

    def modelled_end(self, request_id: str) -> float | None: ...


def chunk_key(request_id: str, stage: int, chunk: int) -> int:
    """The key chunk `chunk` of a request's hidden states travels under to stage `stage`."""
    return xxhash.xxh3_64_intdigest(struct.pack("<II", stage, chunk) + request_id.encode(), seed=HASH_SEED)


class StageInbox(BlockService):
    """Hidden states sent to this stage, held until its `take`. At most `max_bytes`: past that a chunk is
    refused (the sender's transfer fails, naming this peer), never buffered without bound; a chunk nobody
    takes (its request ended here first) expires after `ttl_s`. Used on the event loop's thread, as
    transports call `put_block`."""

    keeps_blocks = True

    def __init__(self, max_bytes: int = 1 << 30, ttl_s: float = 60.0):
        self.max_bytes, self.ttl_s = max_bytes, ttl_s
        self.num_bytes = 0
        self._chunks: dict[int, tuple[bytes | memoryview, float]] = {}  # key -> (data, expiry)
        self._waiting: dict[int, asyncio.Future] = {}

    def put_block(self, key: int, data, checksum: int | None = None) -> str | None:
        now = time.monotonic()
        self._expire(now)
        size = memoryview(data).nbytes
        if key in self._chunks:
            return None  # a resend of a chunk already here
        waiter = self._waiting.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(data)
            return None
        if self.num_bytes + size > self.max_bytes:
            return f"the stage inbox is full ({self.num_bytes} of {self.max_bytes} bytes held)"
        self._chunks[key] = (data, now + self.ttl_s)
        self.num_bytes += size
        return None

    def get_block(self, key: int):
        return None  # chunks are pushed, never fetched

    def __contains__(self, key: int) -> bool:
        return key in self._chunks

    async def take(self, key: int, timeout_s: float, what: str) -> bytes | memoryview:
        """The chunk under `key`, waiting up to `timeout_s`; TransferError naming `what` if it is not in."""
        if (data := self._pop(key)) is not None:
            return data
        waiter = self._waiting[key] = asyncio.get_running_loop().create_future()
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        except asyncio.TimeoutError:
            raise TransferError(f"{what}: nothing from the previous stage within {timeout_s:.1f} s") from None
        finally:
            self._waiting.pop(key, None)

    def drop(self, keys: list[int]) -> None:
        """Forget chunks of a request that ended early (arrived or still to come)."""
        for key in keys:
            self._pop(key)
            waiter = self._waiting.pop(key, None)
            if waiter is not None and not waiter.done():
                waiter.cancel()

    def _pop(self, key: int):
        entry = self._chunks.pop(key, None)
        if entry is None:
            return None
        self.num_bytes -= memoryview(entry[0]).nbytes
        return entry[0]

    def _expire(self, now: float) -> None:
        for key in [k for k, (_, expiry) in self._chunks.items() if expiry <= now]:
            self._pop(key)


async def run_stage(stage: Stage, index: int, request_id: str, chunk_sizes: list[int],
                    compute: Compute, inbox: StageInbox | None, transport: Transport | None,
                    next_peer: str | None, deadline: float,
                    on_chunk: Callable[[int], None] | None = None) -> torch.Tensor | None:
    """Stage `index`'s part in a prompt already `begin`-ed on it: every chunk through its layers, the
    hidden states sent to `next_peer`'s inbox (none after the last stage); `on_chunk(j)` after chunk j is
    computed (where the stage starts pushing its KV to decode). Returns the last stage's logits
    of the prompt's last token, None on other stages. `deadline` (time.monotonic) bounds every wait; a
    failed or late transfer raises TransferError naming the peer and the request.

    A chunk's send runs while the stage computes the next chunk, as a pipeline's stage hands on and goes
    on; with an emulated model, a `transfer/modelled.py` transport takes the activations' modelled
    transfer time, as the simulator charges it (`cost.pipeline_ends`)."""
    logits = None
    sends: list[asyncio.Task] = []
    previous_end = None  # the last chunk's end on an emulated device
    try:
        for j, size in enumerate(chunk_sizes):
            what = f"request {request_id} stage {index} chunk {j}"
            hidden, waiting = None, False
            if index > 0:
                key = chunk_key(request_id, index, j)
                waiting = key not in inbox
                data = await inbox.take(key, time_left(deadline, what), what)
                # NOTE: checked off the event loop, kept on the host: `stage.run` moves it to the device
                hidden = await asyncio.to_thread(decode_hidden, data)
            # NOTE: a chunk that was here before the last one ended starts at that one's modelled end
            try:  # NOTE: the chunk may wait for its turn in the engine's steps, within the deadline too
                since = None if waiting else previous_end
                out = await asyncio.wait_for(compute(stage, request_id, size, hidden, since), time_left(deadline, what))
            except asyncio.TimeoutError:
                raise TransferError(f"{what}: not computed by the deadline (the engine's steps were busy)") from None
            if (end := stage.modelled_end(request_id)) is not None:
                previous_end = min(time.perf_counter(), end)
            if on_chunk is not None:
                on_chunk(j)
            if next_peer is None:
                logits = out
                continue
            payload = await asyncio.to_thread(encode_hidden, out)
            sends.append(asyncio.ensure_future(_send_on(transport, next_peer, request_id, index, j, payload,
                                                        deadline)))
            for done in (t for t in sends if t.done()):
                done.result()  # a failed send ends the stage now, not after its last chunk
        await asyncio.gather(*sends)
    finally:
        for send in sends:
            send.cancel()
    return logits


async def _send_on(transport: Transport, peer: str, request_id: str, index: int, chunk: int, payload,
                   deadline: float) -> None:
    what = f"request {request_id} stage {index} chunk {chunk}"
    # NOTE: a transfer id per chunk: several of a stage's sends may be in flight at once.
    result = await transport.send(peer, [(chunk_key(request_id, index + 1, chunk), payload)],
                                  time_left(deadline, what), request_id=f"{request_id}/s{index}/c{chunk}",
                                  self_checked=True)
    if not result.ok:
        raise TransferError(f"{what}: stage {index + 1} at {peer} refused the hidden states "
                            f"({result.blocks[0].error})")


def time_left(deadline: float, what: str) -> float:
    """Seconds to `deadline` (time.monotonic); TransferError naming `what` once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferError(f"{what}: past the deadline")
    return left

"""How a prefill moves KV, whole (worker.py) or as one stage of a CPP group (stages.py): the prompt's
cached prefix read from the cache pool, and the blocks it computed pushed to decode's inbox."""

import time
from dataclasses import dataclass

from mooncake.errors import KVPayloadError
from mooncake.kv_payload import KVPayload
from mooncake.store.client import CacheClient
from mooncake.transfer.contract import TransferError, TransferResult, Transport


@dataclass
class PrefixRead:
    """The leading blocks of a wanted run the pool served whole and sound, in order, up to the first it
    did not: `missing` is that block's index in the run (None: every one came), `error` why."""

    payloads: list[KVPayload]
    num_bytes: int
    seconds: float
    missing: int | None = None
    error: str = ""
    bad_key: int | None = None  # the block the pool served corrupted: the caller removes it from the pool


async def read_prefix(cache: CacheClient, keys: list[int]) -> PrefixRead:
    """Blocks `keys` (a prompt's consecutive blocks) from the cache pool, checked as KVPayloads."""
    started = time.perf_counter()
    found = await cache.get_blocks(keys)
    read = PrefixRead([], 0, 0.0)
    for i, key in enumerate(keys):
        if (data := found.get(key)) is None:
            read.missing, read.error = i, f"the cache pool no longer holds block {key:#x}"
            break
        read.num_bytes += len(data)
        try:
            read.payloads.append(KVPayload.from_bytes(data))
        except KVPayloadError as exc:
            read.missing, read.error, read.bad_key = i, f"pool block {key:#x}: {exc}", key
            break
    read.seconds = time.perf_counter() - started
    return read


async def push_to_decode(transport: Transport, decode_id: str, address: str, request_id: str, blocks: list,
                         timeout_s: float, transfer_id: str, what: str = "") -> TransferResult:
    """KV payloads into decode's inbox at `address`; TransferError naming decode, the block it did not take
    and the request when one was refused. Sent `self_checked`: decode verifies each payload as it
    imports it (one check). `transfer_id` is the push's own: several of a request's may be in flight."""
    result = await transport.send(address, blocks, timeout_s, transfer_id, self_checked=True)
    if not result.ok:
        bad = next(b for b in result.blocks if not b.ok)
        raise TransferError(f"decode {decode_id} at {address} did not take block {bad.key:#x} of request "
                            f"{request_id}{what}: {bad.error}")
    return result

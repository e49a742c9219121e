"""Chained prefix-block hashes (DESIGN section 2-4), shared by every role, and the payload checksum every
KV block carries.

h_i = xxh3_64(h_{i-1} as u64 LE || token ids of block i as u32 LE || namespace), with a fixed seed,
so the same prefix of the same model gives the same keys on every node. Only full blocks are hashed.

Who hashes: the API process hashes a prompt once and the hashes travel in every message of the request;
the conductor's prefix index, the pool reads and the decode inbox's claims use them as they came. An
engine (a prefill or decode instance, a CPP stage) hashes the tokens it caches once more, when the request
is added: its prefix cache files KV under those keys and serves it to every later request with that
prefix, so a key there must be a function of the very tokens it computed, never one a message said (a
wrong key, from a bug or a peer, would serve one prompt's KV to another). That costs about 0.4 ms for an
8k-token prompt at 16 tokens per block, 0.1 ms at 64 (`hash_blocks`, one xxh3 call per block).

The checksum of a large block is a sum of chunk sums, so that this process's one checksum worker thread
and the calling thread share it.
"""

import os
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import xxhash

HASH_SEED = 0x4D4F4F4E  # "MOON": fixed, never per process, so hashes agree across nodes.
ROOT_HASH = 0
CHECKSUM_CHUNK_BYTES = 512 << 10  # part of the checksum's definition: changing it changes every checksum
PARALLEL_MIN_BYTES = 8 << 20  # a bare checksum; below it, waking the worker costs what it saves
T = TypeVar("T")
_xxh3 = xxhash.xxh3_64_intdigest


def make_namespace(model_id: str, block_size: int, dtype: str) -> bytes:
    """The namespace that keeps two models (or two block sizes, or KV of two dtypes) from ever sharing a
    key: a pool that held float32 blocks serves none of them to a bfloat16 cluster."""
    return f"{model_id}/bs{block_size}/{dtype}".encode()


def salt_root(*salts: str) -> int:
    """The root of a request's block hash chain (the parent of its first block): ROOT_HASH for the shared
    prefix cache, else a hash of its cache salts (an API key's, then the request's `cache_salt`). Requests
    with different salts share no block, so no client reuses another's KV or learns from `cached_tokens`
    what another sent, as vLLM's `cache_salt`."""
    if not any(salts):
        return ROOT_HASH
    # NOTE: each salt length-prefixed, so no request's salt can spell another key's salt and request salt.
    encoded = b"mooncake cache salt" + b"".join(len(b := s.encode()).to_bytes(4, "little") + b for s in salts)
    return xxhash.xxh3_64_intdigest(encoded, seed=HASH_SEED) or 1  # never the shared root


def hash_block(parent_hash: int, token_ids: Sequence[int], namespace: bytes) -> int:
    """Hash of one block given its parent's hash."""
    h = xxhash.xxh3_64(seed=HASH_SEED)
    h.update(int(parent_hash).to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype="<u4").tobytes())
    h.update(namespace)
    return h.intdigest()


def hash_blocks(token_ids: Sequence[int], block_size: int, namespace: bytes,
                parent_hash: int = ROOT_HASH) -> list[int]:
    """Chained hashes of every full block of `token_ids`; a trailing partial block is not hashed. The same
    as `hash_block` block by block, in one xxh3 call per block over one buffer (3x as fast)."""
    tokens = np.asarray(token_ids, dtype="<u4").tobytes()
    step, hashes, parent_hash = 4 * block_size, [], int(parent_hash)
    for start in range(0, len(tokens) - step + 1, step):
        parent_hash = _xxh3(parent_hash.to_bytes(8, "little") + tokens[start:start + step] + namespace,
                            seed=HASH_SEED)
        hashes.append(parent_hash)
    return hashes


def layer_key(block_hash: int, layer: int) -> int:
    """The key one layer's slice of a block travels under (layer-wise KV streaming): distinct from the
    block's own hash and from every other layer's, the same on every node."""
    return xxhash.xxh3_64_intdigest(struct.pack("<QI", block_hash, layer), seed=HASH_SEED)


def checksum(data) -> int:
    """Payload checksum of any contiguous buffer. Up to CHECKSUM_CHUNK_BYTES: xxh3-64 of the raw bytes.
    Above: xxh3-64 of the xxh3-64 digests of its CHECKSUM_CHUNK_BYTES chunks (u64 LE, in order), a
    two-level sum, so that a large block is hashed on two threads (from PARALLEL_MIN_BYTES up) and can be
    hashed chunk by chunk while it is copied, on two threads from 2 MiB (mooncake/transfer/passes.py)."""
    view = byte_view(data)
    size = len(view)
    if size <= CHECKSUM_CHUNK_BYTES:
        return _xxh3(view)
    if size < PARALLEL_MIN_BYTES or threading.get_ident() == _worker_ident:  # the common case, kept lean
        chunk = CHECKSUM_CHUNK_BYTES
        return combine_digests([_xxh3(view[i:i + chunk]) for i in range(0, size, chunk)])
    return combine_digests(by_chunks(size, lambda start, stop: _xxh3(view[start:stop])))


def combine_digests(digests: list[int]) -> int:
    """The checksum of a block larger than one chunk, from its chunks' digests in order."""
    return _xxh3(struct.pack(f"<{len(digests)}Q", *digests))


def byte_view(data) -> memoryview:
    view = memoryview(data)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def by_chunks(size: int, work: Callable[[int, int], T], parallel_from: int = PARALLEL_MIN_BYTES) -> list[T]:
    """`work(start, stop)` over each CHECKSUM_CHUNK_BYTES chunk of `size` bytes; the results in chunk order.
    From `parallel_from` bytes up the worker thread takes every other chunk while the calling thread does
    the rest (numpy copies and xxhash release the GIL). Below it, handing work to the worker costs more than
    it saves: in real transfers it has often slept, and it and the caller trade the GIL between chunks.
    Measured between two processes, hashing a 2.81 MiB block on two threads made tcp sends 0.85x as fast.
    `work` must not itself call `by_chunks`."""
    starts = range(0, size, CHECKSUM_CHUNK_BYTES)

    def run(part: range) -> list[T]:
        return [work(start, min(start + CHECKSUM_CHUNK_BYTES, size)) for start in part]

    if size < parallel_from or threading.get_ident() == _worker_ident:
        return run(starts)
    evens = checksum_worker().submit(run, starts[0::2])
    try:
        odds = run(starts[1::2])
    finally:
        done = evens.result()  # waited for even if this thread failed: `work` may still be writing
    results = [None] * len(starts)
    results[0::2], results[1::2] = done, odds
    return results


_worker: ThreadPoolExecutor | None = None
_worker_ident: int | None = None


def checksum_worker() -> ThreadPoolExecutor:
    """This process's one checksum worker thread (a `checksum` run on it stays on it)."""
    global _worker
    if _worker is None:
        _worker = ThreadPoolExecutor(1, thread_name_prefix="mooncake-checksum", initializer=_mark_worker)
    return _worker


def _mark_worker() -> None:
    global _worker_ident
    _worker_ident = threading.get_ident()


def _forget_pool() -> None:
    global _worker, _worker_ident
    _worker, _worker_ident = None, None  # a forked child has no threads: it starts its own when it needs one


os.register_at_fork(after_in_child=_forget_pool)

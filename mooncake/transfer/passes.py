"""A block's copy and its checksum, overlapped. From PARALLEL_MIN_BYTES up, the checksum runs on one
worker thread while the calling thread copies (numpy and xxhash both release the GIL), so on a host with
a spare core a transfer pays about one pass over the block instead of two; below it, handing work to a
thread costs more than it saves.

Used by the transports that copy: the sender's copy into shared memory (`copy_summed`), and the
receiver's private copy of a block it does not own (`copy_checked`)."""

import os
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from mooncake.hashing import checksum, checksum_stream

PARALLEL_MIN_BYTES = 2 << 20
CHUNK_BYTES = 1 << 20  # the receiver hashes its copy chunk by chunk, one chunk behind the copy

_worker: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _worker
    if _worker is None:  # one thread: hash updates submitted in order run in order
        _worker = ThreadPoolExecutor(1, thread_name_prefix="mooncake-checksum")
    return _worker


def _forget_pool() -> None:
    global _worker
    _worker = None  # a forked child has no threads: it starts its own worker when it needs one


os.register_at_fork(after_in_child=_forget_pool)


def copy_summed(dst: np.ndarray, src) -> int:
    """Copy `src` (any buffer) into `dst` (a uint8 array of its length); the checksum of `src`."""
    source = np.frombuffer(src, dtype=np.uint8)
    if len(source) < PARALLEL_MIN_BYTES:
        np.copyto(dst, source)
        return checksum(src)
    summed = _pool().submit(checksum, src)
    np.copyto(dst, source)
    return summed.result()


def copy_checked(src) -> tuple[bytes | memoryview, int]:
    """A private copy of `src` and the checksum of that copy, not of `src`: the source may lie in memory
    another process can still write, so what is verified must be exactly what is returned. From
    PARALLEL_MIN_BYTES up, the worker hashes chunk k of the copy while this thread copies chunk k+1."""
    source = np.frombuffer(src, dtype=np.uint8)
    if len(source) < PARALLEL_MIN_BYTES:
        copy = source.tobytes()
        return copy, checksum(copy)
    copy = np.empty_like(source)
    state, pool = checksum_stream(), _pool()
    last: Future | None = None
    for start in range(0, len(source), CHUNK_BYTES):
        chunk = slice(start, start + CHUNK_BYTES)
        np.copyto(copy[chunk], source[chunk])
        last = pool.submit(state.update, copy[chunk])
    last.result()
    return memoryview(copy), state.intdigest()

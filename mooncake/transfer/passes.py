"""A block's copy and its checksum, overlapped, for the transports that copy. From PARALLEL_COPY_MIN_BYTES
up both use this process's checksum worker thread (mooncake/hashing.py), since numpy copies and xxhash
release the GIL; below it, handing work to a thread costs more than it saves (a bare checksum gains from
the worker only at a larger size, hashing.PARALLEL_MIN_BYTES: with a copy there is more to share).

- `copy_summed`, the sender's copy into shared memory: the worker hashes the source while this thread
  copies it in one piece. A copy into memory not in cache is bound by write bandwidth, so splitting it
  over two threads gains little, and each would then pay its share of the hash on top (measured: 2.81 MiB
  into a window, 290 us this way, 360 us split; even at 16 MiB, split wins only about 8%).
- `copy_checked`, the receiver's private copy of a block it does not own: the hash must be of the copy,
  so each thread copies every other chunk and hashes it right after, while it is still in cache."""

import numpy as np
import xxhash

from mooncake.hashing import CHECKSUM_CHUNK_BYTES, by_chunks, checksum, checksum_worker, combine_digests

PARALLEL_COPY_MIN_BYTES = 2 << 20


def copy_summed(dst: np.ndarray, src) -> int:
    """Copy `src` (any buffer) into `dst` (a uint8 array of its length); the checksum of `src`."""
    source = np.frombuffer(src, dtype=np.uint8)
    if len(source) < PARALLEL_COPY_MIN_BYTES:
        np.copyto(dst, source)
        return checksum(source)
    summed = checksum_worker().submit(checksum, source)  # on the worker, a checksum stays on it
    try:
        np.copyto(dst, source)
    finally:
        digest = summed.result()
    return digest


def copy_checked(src) -> tuple[memoryview, int]:
    """A private copy of `src` and the checksum of that copy, not of `src`: the source may lie in memory
    another process can still write, so what is verified must be exactly what is returned."""
    source = np.frombuffer(src, dtype=np.uint8)
    if len(source) < PARALLEL_COPY_MIN_BYTES or len(source) <= CHECKSUM_CHUNK_BYTES:  # one copy, then one hash
        copy = source.tobytes()
        return memoryview(copy), checksum(copy)
    copy = np.empty_like(source)

    def chunk(start: int, stop: int) -> int:
        np.copyto(copy[start:stop], source[start:stop])
        return xxhash.xxh3_64_intdigest(copy[start:stop])

    return memoryview(copy), combine_digests(by_chunks(len(source), chunk, PARALLEL_COPY_MIN_BYTES))

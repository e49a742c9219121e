"""A block's copy and its checksum in one pass: chunk by chunk, each chunk hashed right after it is
copied, while it is still in the core's cache, and from PARALLEL_MIN_BYTES up the checksum worker thread
copies and hashes every other chunk (mooncake/hashing.py). A transfer so pays about one pass over the
block, on two cores, instead of a copy and then a read.

Used by the transports that copy: the sender's copy into shared memory (`copy_summed`), and the
receiver's private copy of a block it does not own (`copy_checked`)."""

import numpy as np
import xxhash

from mooncake.hashing import CHECKSUM_CHUNK_BYTES, by_chunks, checksum, combine_digests


def _copy_hashing(dst: np.ndarray, source: np.ndarray, hashed: np.ndarray) -> int:
    """Copy `source` into `dst` (uint8 arrays of one length); the checksum of `hashed`, which is one of
    the two."""
    if len(source) <= CHECKSUM_CHUNK_BYTES:
        np.copyto(dst, source)
        return checksum(hashed)

    def chunk(start: int, stop: int) -> int:
        np.copyto(dst[start:stop], source[start:stop])
        return xxhash.xxh3_64_intdigest(hashed[start:stop])

    return combine_digests(by_chunks(len(source), chunk))


def copy_summed(dst: np.ndarray, src) -> int:
    """Copy `src` (any buffer) into `dst` (a uint8 array of its length); the checksum of `src`."""
    source = np.frombuffer(src, dtype=np.uint8)
    return _copy_hashing(dst, source, source)


def copy_checked(src) -> tuple[memoryview, int]:
    """A private copy of `src` and the checksum of that copy, not of `src`: the source may lie in memory
    another process can still write, so what is verified must be exactly what is returned."""
    source = np.frombuffer(src, dtype=np.uint8)
    copy = np.empty_like(source)
    return memoryview(copy), _copy_hashing(copy, source, copy)

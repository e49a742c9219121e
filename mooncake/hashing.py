"""Chained prefix-block hashes (DESIGN section 2-4), computed once and shared by every role.

h_i = xxh3_64(h_{i-1} as u64 LE || token ids of block i as u32 LE || namespace), with a fixed seed,
so the same prefix of the same model gives the same keys on every node. Only full blocks are hashed.
"""

from collections.abc import Sequence

import numpy as np
import xxhash

HASH_SEED = 0x4D4F4F4E  # "MOON": fixed, never per process, so hashes agree across nodes.
ROOT_HASH = 0


def make_namespace(model_id: str, block_size: int) -> bytes:
    """The namespace that keeps two models (or two block sizes) from ever sharing a key."""
    return f"{model_id}/bs{block_size}".encode()


def hash_block(parent_hash: int, token_ids: Sequence[int], namespace: bytes) -> int:
    """Hash of one block given its parent's hash."""
    h = xxhash.xxh3_64(seed=HASH_SEED)
    h.update(int(parent_hash).to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype="<u4").tobytes())
    h.update(namespace)
    return h.intdigest()


def hash_blocks(token_ids: Sequence[int], block_size: int, namespace: bytes,
                parent_hash: int = ROOT_HASH) -> list[int]:
    """Chained hashes of every full block of `token_ids`; a trailing partial block is not hashed."""
    tokens = np.asarray(token_ids, dtype="<u4")
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, tokens[start:start + block_size], namespace)
        hashes.append(parent_hash)
    return hashes


def checksum(data) -> int:
    """Payload checksum (xxh3-64 of the raw bytes); any buffer-protocol object works."""
    return xxhash.xxh3_64_intdigest(data)


def checksum_stream():
    """An incremental form of `checksum`: `.update(chunk)` in order, then `.intdigest()` equals
    `checksum` of the whole."""
    return xxhash.xxh3_64()

"""The keyed checks KV payloads and stage activations carry (mooncake/kv_payload.py, engine/stage.py), so
that every KV byte is under the cluster's key wherever it travels or rests (transports, the pool, SSD):

- `data_mac(data)`: AES-GMAC of the bytes, one pass (about as fast as xxh3 on a CPU with AES and carry-less
  multiply instructions), under `security.kv_key()`; 28 bytes: a nonce that is never used twice (this
  process's random 8-byte prefix, a 4-byte counter) and the 16-byte tag. `data_mac_ok` checks one.
- `header_digest(header)`: a keyed BLAKE2b-64 of a small header (which holds the data's MAC), what a
  sealed transport header binds an encoded payload by (`kv_payload.bound_digest`).

Without cluster keys both use a fixed key: a check against accidents, not against an attacker."""

import hashlib
import hmac
import itertools
import os
import struct
import threading

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from mooncake import security

MAC_BYTES = 28  # nonce (12) + tag (16)
_NONCE_PREFIX_BYTES = 8
_COUNTER_LIMIT = 1 << 32
_lock = threading.Lock()
_state = (os.urandom(_NONCE_PREFIX_BYTES), itertools.count())  # this process's nonce prefix, its counter
_ciphers: dict[bytes, AESGCM] = {}
_header_keys: dict[bytes, bytes] = {}


def _renew_nonces() -> None:
    global _state
    _state = (os.urandom(_NONCE_PREFIX_BYTES), itertools.count())


os.register_at_fork(after_in_child=_renew_nonces)  # NOTE: a forked child must not repeat its parent's nonces


def _cipher() -> AESGCM:
    key = security.kv_key()
    cipher = _ciphers.get(key)
    if cipher is None:
        cipher = _ciphers[key] = AESGCM(key)
    return cipher


def _nonce() -> bytes:
    while True:
        prefix, counter = state = _state  # NOTE: a prefix with its own counter, whatever other threads do
        n = next(counter)
        if n < _COUNTER_LIMIT:
            return prefix + struct.pack("<I", n)
        with _lock:
            if _state is state:
                _renew_nonces()


def data_mac(data) -> bytes:
    """The MAC of a contiguous buffer: nonce || tag."""
    nonce = _nonce()
    return nonce + _cipher().encrypt(nonce, b"", memoryview(data).cast("B"))


def data_mac_ok(data, mac: bytes) -> bool:
    if not isinstance(mac, bytes) or len(mac) != MAC_BYTES:
        return False
    tag = _cipher().encrypt(mac[:12], b"", memoryview(data).cast("B"))
    return hmac.compare_digest(tag, mac[12:])


def header_digest(header: bytes) -> int:
    """A keyed 64-bit digest of a small header (under a key of its own, derived from the MAC's)."""
    key = security.kv_key()
    header_key = _header_keys.get(key)
    if header_key is None:
        header_key = _header_keys[key] = hashlib.blake2b(b"mooncake KV header digest", key=key).digest()
    return int.from_bytes(hashlib.blake2b(header, key=header_key, digest_size=8).digest(), "little")

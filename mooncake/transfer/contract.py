"""The transport contract: batch send and fetch of KV blocks to and from a peer, with a deadline,
checksums verified by the receiver, a result per block and per-transfer metrics.

A block that carries its own check (an encoded KVPayload, checked end to end by its consumer) is sent
with `self_checked=True`: no transport hashes it; its checksum field is its `kv_payload.bound_digest`
(negative, read from the payload's header, not hashed), which the receiver matches and which travels from
the sender through a cache node's store to whoever fetches it. So the seal on a message's header covers
every byte of its payloads too. Only frames with no check of their own are hashed by the transport.

Callers: the cache role `start()`s a transport with a `BlockService` (its store) so peers can put and get
blocks; prefill and decode instances `send()` new blocks and `fetch()` cached ones. Backends (found by name
in `mooncake.registry`): `backends/transports/inproc.py` (tests), `tcp.py` (ZeroMQ), `shm.py` (same host)."""

import itertools
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from mooncake.errors import MooncakeError


SELF_CHECKED = -1
"""A checksum field that binds no byte (what self-checked blocks carried before their bound digests): every
receiver refuses it. Checksums are u64; a payload's bound digest is at most -2."""


class TransferError(MooncakeError):
    """A whole transfer failed (dead peer, deadline passed); the message names the peer and request."""


class BlockService(ABC):
    """What a serving endpoint exposes: the cache role's store (`store/server.py:StoreService`) and the
    decode inbox (`decode/inbox.py`). Optional capabilities are declared here as class attributes that a
    service turns on; transports read them, and call the methods they enable, instead of probing."""

    keeps_blocks: bool = False
    """True: `put_block`'s data stays valid for as long as the service holds it (a transport copies out of
    its reused buffers first, hashing as it copies), so the service keeps it uncopied. False: data may be
    a view valid only during the call."""

    locates_blocks: bool = False
    """True: a fetch is served by `locate_block` (the bytes, their known checksum and where they lie in
    shared memory) instead of `get_block` and a fresh hash."""

    lends_windows: bool = False
    """True: the service lends ranges of its shared memory to same-host writers, who put blocks by writing
    them in place (`open_window`, `commit_window`, `close_window`; mooncake/transfer/windows.py)."""

    @abstractmethod
    def put_block(self, key: int, data: memoryview, checksum: int | None = None) -> str | None:
        """Store a verified block; None on success, else a one-line reason. `checksum` is the one the
        transport verified, for a service that keeps it (so the block is never hashed again), or
        a payload's bound digest for a block that carries its own check (kept and served back as such)."""

    @abstractmethod
    def get_block(self, key: int) -> bytes | memoryview | None:
        """The block's bytes, or None if absent."""

    def locate_block(self, key: int) -> "BlockLocation | None":
        """With `locates_blocks`: the block as it lies, or None if absent."""
        raise NotImplementedError(f"{type(self).__name__} does not declare locates_blocks")

    def open_window(self, want: int, need: int) -> tuple[int, str, int, int, float] | None:
        """With `lends_windows`: (window id, shared file, offset, size, idle seconds before it is taken
        back), or None if it cannot lend one now."""
        raise NotImplementedError(f"{type(self).__name__} does not declare lends_windows")

    def commit_window(self, window_id: int, blocks: list[tuple[int, int, int, int]]) -> list[str | None]:
        raise NotImplementedError(f"{type(self).__name__} does not declare lends_windows")

    def close_window(self, window_id: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not declare lends_windows")


@dataclass(frozen=True)
class BlockLocation:
    """A block a service serves without re-hashing: its bytes, its known checksum and, when it lies in a
    shared-memory file a same-host peer can map, that file and the offset."""

    data: bytes | memoryview
    checksum: int
    shm_path: str | None = None
    offset: int = 0


@dataclass(frozen=True)
class BlockResult:
    key: int
    error: str | None = None  # None: the block arrived and verified
    data: bytes | memoryview | None = None  # fetched bytes (fetch only)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class TransferResult:
    peer: str
    request_id: str
    blocks: list[BlockResult]
    num_bytes: int  # payload bytes moved (verified or not)
    seconds: float

    @property
    def ok(self) -> bool:
        return all(b.ok for b in self.blocks)

    @property
    def gbytes_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class Transport(ABC):
    """One process's endpoint. Every wait is bounded by the caller's `timeout_s`."""

    name: str

    served: Mapping[str, dict] = MappingProxyType({})
    """What it served to peers, per op ("put", "get"): requests, bytes, seconds. Backends that serve
    over a wire (tcp and those built on it) count them; the cache role reports them in its stats."""

    @classmethod
    def from_config(cls, config, host: str) -> "Transport":
        """This backend set up from a [transport] table (`TransportConfig`); `host` is where its endpoint
        listens and what peers are told. Backends with settings of their own override this."""
        return cls(host=host)

    @abstractmethod
    async def start(self, service: BlockService | None = None, address: str | None = None) -> str:
        """Start; with a `service`, also serve peers. Returns the address peers use for this endpoint."""

    @abstractmethod
    async def send(self, peer: str, blocks: list[tuple[int, bytes | memoryview]], timeout_s: float,
                   request_id: str | None = None, self_checked: bool = False) -> TransferResult:
        """Put blocks into the peer's service; per-block results say which were stored. `self_checked`:
        every block carries its own check (an encoded payload): neither side hashes it; its bound digest binds
        it to the sealed header."""

    @abstractmethod
    async def fetch(self, peer: str, keys: list[int], timeout_s: float,
                    request_id: str | None = None) -> TransferResult:
        """Get blocks from the peer's service; a missing or corrupted block is a per-block error (a block
        stored with a bound digest is matched to it here, and its bytes checked by its consumer)."""

    @abstractmethod
    async def stop(self) -> None: ...

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.stop()


_id_prefix = ""
_id_counter = itertools.count()


def _new_id_prefix() -> None:
    """A random prefix per process (a forked child draws its own), so that ids from different senders
    do not collide; a counter after it is far cheaper than a uuid per request."""
    global _id_prefix, _id_counter
    _id_prefix, _id_counter = os.urandom(5).hex(), itertools.count()


_new_id_prefix()
os.register_at_fork(after_in_child=_new_id_prefix)


def new_request_id() -> str:
    return f"{_id_prefix}{next(_id_counter):x}"


def make_transport(name: str, config) -> Transport:
    """The transport registered as `name`, built from a MooncakeConfig's [transport] table, listening on
    and advertising this host's address (mooncake/addresses.py)."""
    from mooncake.addresses import advertise_host
    from mooncake.registry import load_backend
    return load_backend("transports", name).from_config(config.transport, advertise_host(config))


def owned_bytes(data) -> bytes | memoryview:
    """Fetched bytes (a `BlockResult.data`) the caller may keep: as they are when the transport already
    made them a private copy (shm and mooncake: a bytes object, or all of a numpy array it allocated),
    else a copy (of a view into a ZeroMQ frame, say)."""
    if isinstance(data, bytes):
        return data
    whole = data.obj if isinstance(data, memoryview) else None
    if isinstance(whole, bytes) and len(whole) == data.nbytes:
        return whole
    if isinstance(whole, np.ndarray) and whole.base is None and whole.nbytes == data.nbytes:
        return data
    return bytes(data)

"""The transport contract: batch send and fetch of KV blocks to and from a peer, with a deadline,
checksums verified by the receiver, a result per block and per-transfer metrics.

Callers: the cache role `start()`s a transport with a `BlockService` (its store) so peers can put and get
blocks; prefill and decode instances `send()` new blocks and `fetch()` cached ones. Backends (found by name
in `mooncake.registry`): `backends/transports/inproc.py` (tests), `tcp.py` (ZeroMQ), `shm.py` (same host)."""

import itertools
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

from mooncake.errors import MooncakeError


class TransferError(MooncakeError):
    """A whole transfer failed (dead peer, deadline passed); the message names the peer and request."""


class BlockService(Protocol):
    """What a serving endpoint exposes: the cache role adapts its KVStore to this."""

    def put_block(self, key: int, data: memoryview) -> str | None:
        """Store a verified block; None on success, else a one-line reason."""

    def get_block(self, key: int) -> bytes | memoryview | None:
        """The block's bytes, or None if absent."""

    # Optional, for services that know more (the cache role's store):
    #   accepts_checksum = True  -> put_block(key, data, checksum) gets the checksum the transport verified
    #   locate_block(key) -> BlockLocation | None, used instead of get_block when present
    # and for services that hold blocks as they are (the decode inbox):
    #   keeps_blocks = True  -> put_block's data stays valid for as long as the service holds it (the
    #   transport copies out of its reused buffers first, hashing as it copies), so it keeps it uncopied;
    #   otherwise data may be a view valid only during the call


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
                   request_id: str | None = None) -> TransferResult:
        """Put blocks into the peer's service; per-block results say which were stored."""

    @abstractmethod
    async def fetch(self, peer: str, keys: list[int], timeout_s: float,
                    request_id: str | None = None) -> TransferResult:
        """Get blocks from the peer's service; a missing or corrupted block is a per-block error."""

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

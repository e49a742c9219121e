"""The cache role: a KVStore served to other roles. Block bytes come and go over the configured
transport; a ZeroMQ ROUTER answers control messages (hello, exists, match_prefix, remove, stats, snapshot);
a PUB socket publishes batched add/evict events for the conductor's prefix index, numbered so a reader
knows when it missed some and must take a snapshot (every key held, SSD-recovered ones included)."""

import asyncio
import dataclasses
import logging
import uuid

import zmq
import zmq.asyncio

from mooncake import messages as m
from mooncake import security
from mooncake.config import MooncakeConfig
from mooncake.errors import CapacityError, MooncakeError
from mooncake.addresses import advertise_host, advertised
from mooncake.runtime import Supervisor
from mooncake.store.store import KVStore
from mooncake.transfer.contract import BlockLocation, BlockService, make_transport
from mooncake.transfer.windows import WriteWindows

log = logging.getLogger(__name__)


class StoreService(BlockService):
    """Adapts the store to the transports' BlockService: capacity errors become per-block errors, and a
    block being sent is pinned by a short lease instead of copied. It also takes the checksum the
    transport verified on a put and hands it back on a read (`locate_block`), so a block is hashed once
    on its way in and never again by this node (a block put SELF_CHECKED, a KV payload, is never hashed
    here at all: its consumer checks it); with a shared DRAM tier, it says where the block lies
    so a same-host reader copies it straight out of the store."""

    locates_blocks = True
    lends_windows = True

    def __init__(self, store: KVStore, read_lease_s: float):
        self.store = store
        self.read_lease_s = read_lease_s
        self.windows = WriteWindows(store)

    # Writes in place, for same-host writers (the shm transport; mooncake/transfer/windows.py).

    def open_window(self, want: int, need: int) -> tuple[int, str, int, int, float] | None:
        """(window id, shared DRAM file, offset, size, idle seconds before it is taken back), or None if
        this store cannot lend one now."""
        path = self.store.tiers[0].path
        opened = self.windows.open(want, need) if path is not None else None
        return None if opened is None else (opened[0], path, opened[1], opened[2], self.windows.ttl_s)

    def commit_window(self, window_id: int, blocks: list[tuple[int, int, int, int]]) -> list[str | None]:
        return self.windows.commit(window_id, blocks)

    def close_window(self, window_id: int) -> None:
        self.windows.close(window_id)

    def put_block(self, key, data, checksum=None):
        try:
            self.store.put(key, data, checksum=checksum)
        except CapacityError as exc:
            return f"capacity: {exc}"
        return None

    def get_block(self, key):
        lease = self.store.get(key, lease_s=self.read_lease_s)
        return None if lease is None else lease.data

    def locate_block(self, key) -> BlockLocation | None:
        lease = self.store.get(key, lease_s=self.read_lease_s)
        if lease is None:
            return None
        where = self.store.dram_location(key) if lease.tier == "dram" else None
        return BlockLocation(lease.data, self.store.checksum_of(key, lease.data),
                             *(where[:2] if where else (None, 0)))


class CacheServer:
    def __init__(self, config: MooncakeConfig):
        self.config = config
        self.name = f"cache node {config.cache.node_id}"
        self.store: KVStore | None = None
        self.transport = None
        self.service: StoreService | None = None
        self.data_address = ""
        self.ctx = None
        self.supervisor: Supervisor | None = None
        self.epoch = uuid.uuid4().hex  # this run of the node, for the readers of its events
        self.seq = 0  # event batches published in this run

    @property
    def fatal(self):
        return self.supervisor.fatal if self.supervisor else None

    async def start(self) -> None:
        cfg = self.config.cache
        # NOTE: over shm, the DRAM tier lives in shared memory so same-host readers copy out of it directly.
        self.store = KVStore(self.config.store, shared_dram=cfg.transport == "shm")
        self.host = advertise_host(self.config)
        self.transport = make_transport(cfg.transport, self.config)
        self.service = StoreService(self.store, cfg.read_lease_s)
        self.data_address = await self.transport.start(self.service, cfg.data_address or None)
        self.ctx = zmq.asyncio.Context()
        self.control = security.server(self.ctx.socket(zmq.ROUTER), role="cache")
        self.events = security.server(self.ctx.socket(zmq.PUB), role="cache")
        for sock, key, address in ((self.control, "cache.control_address", cfg.control_address),
                                   (self.events, "cache.events_address", cfg.events_address)):
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.bind(address)
            except zmq.ZMQError as exc:
                await self.stop()
                raise MooncakeError(f"{self.name}: cannot listen on {key} = {address}: {exc}") from None
        self.supervisor = Supervisor(self.name)
        self.supervisor.spawn(self._serve_control(), "the control loop")
        self.supervisor.spawn(self._publish_events(), "the event publisher")
        log.info("%s ready: control %s, events %s, data %s (%s), store %s", self.name, cfg.control_address,
                 cfg.events_address, self.data_address, cfg.transport, self.store.num_blocks())

    async def stop(self) -> None:
        """Reverse order of start; safe to call on a half-started server."""
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self.transport is not None:
            await self.transport.stop()
            self.transport = None
        if self.ctx is not None:
            for sock in (self.control, self.events):
                sock.close(linger=0)
            security.release(self.ctx)
            self.ctx.term()
            self.ctx = None
        if self.store is not None:
            self.store.close()
            self.store = None

    async def _serve_control(self) -> None:
        while True:
            identity, *frames = await self.control.recv_multipart()
            try:
                reply = self.handle(frames)
            except Exception:  # noqa: BLE001  one request must not end the control loop
                log.exception("%s: a control request failed", self.name)
                reply = m.ErrorReply(error="internal error; see the cache node's log")
            await self.control.send_multipart([identity, m.encode(reply)])

    def handle(self, frames: list[bytes]):
        """One control request in, one reply out; a malformed request gets an ErrorReply and a log line."""
        try:
            if len(frames) != 1:
                raise m.MessageError(f"expected 1 frame, got {len(frames)}")
            request = m.decode(frames[0])
        except m.MessageError as exc:
            log.warning("%s: malformed control message: %s", self.name, exc)
            return m.ErrorReply(error=f"malformed message: {exc}")
        cfg = self.config.cache
        if isinstance(request, m.Hello):
            return m.HelloReply(node_id=cfg.node_id, transport=cfg.transport, data_address=self.data_address,
                                events_address=advertised(cfg.events_address, self.host))
        if isinstance(request, m.Exists):
            return m.ExistsReply(tiers=[self.store.exists(k) for k in request.keys])
        if isinstance(request, m.MatchPrefix):
            return m.MatchPrefixReply(tiers=self.store.match_prefix(request.keys))
        if isinstance(request, m.Remove):
            return m.RemoveReply(removed=[self.store.remove(k) for k in request.keys])
        if isinstance(request, m.Stats):
            return m.StatsReply(stats=self.stats())
        if isinstance(request, m.Snapshot):
            return m.SnapshotReply(node_id=cfg.node_id, epoch=self.epoch, seq=self.seq, keys=self.store.keys())
        log.warning("%s: unexpected control message %s", self.name, type(request).__name__)
        return m.ErrorReply(error=f"a cache node does not answer {request.TAG!r}")

    def stats(self) -> dict:
        # NOTE: not dataclasses.asdict: it rebuilds a Counter from (key, value) pairs, counting the pairs.
        metrics = {f.name: getattr(self.store.metrics, f.name) for f in dataclasses.fields(self.store.metrics)}
        return {**{k: dict(v) if isinstance(v, dict) else v for k, v in metrics.items()},
                "blocks": self.store.num_blocks(),
                "leased_blocks": self.store.num_leased(),
                "used_bytes": {t.name: t.used_bytes for t in self.store.tiers},  # DRAM: lent windows too
                "write_windows": {"open": len(self.service.windows), "lent_bytes": self.service.windows.lent_bytes()},
                "capacity_bytes": {t.name: t.capacity_bytes for t in self.store.tiers},
                "transfers": {op: {**v, "gbytes_per_s": v["bytes"] / v["seconds"] / 1e9 if v["seconds"] else 0.0}
                              for op, v in self.transport.served.items()}}

    async def _publish_events(self) -> None:
        while True:
            await asyncio.sleep(self.config.cache.event_interval_s)
            self.service.windows.expire()  # a writer that died leaves its window: take it back in time
            events = self.store.drain_events()
            if events:
                batch = [(e.kind, e.key, e.tier) for e in events]
                self.seq += 1
                await self.events.send(m.encode(m.StoreEvents(node_id=self.config.cache.node_id, events=batch,
                                                              epoch=self.epoch, seq=self.seq)))

"""Feeds the global prefix index from the cache nodes: asks each node (retrying until it answers) where
it publishes, subscribes, and applies its batched add/evict events under the node's id. Also polls each
node's counters for the conductor's /metrics."""

import asyncio
import logging

import zmq
import zmq.asyncio

from mooncake import messages as m
from mooncake import security
from mooncake.conductor.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

RETRY_S = 1.0
STATS_INTERVAL_S = 2.0


class PoolWatcher:
    def __init__(self, nodes: tuple[str, ...], index: PrefixIndex, timeout_s: float, on_stats=None):
        self.nodes = nodes
        self.on_stats = on_stats  # called with (node id, stats dict) every STATS_INTERVAL_S
        self.index = index
        self.timeout_s = timeout_s
        self.ctx = zmq.asyncio.Context()
        self.node_ids: dict[str, str] = {}  # control address -> node id, once it answered
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._watch(address)) for address in self.nodes]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.ctx.destroy(linger=0)

    async def _ask(self, address: str, request):
        """One request/reply with a node on a fresh socket (so a late reply never answers the next
        question); None if it did not answer in time."""
        sock = security.client(self.ctx.socket(zmq.DEALER))
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        try:
            await sock.send(m.encode(request))
            return m.decode(await asyncio.wait_for(sock.recv(), self.timeout_s))
        except (asyncio.TimeoutError, m.MessageError):
            return None
        finally:
            sock.close(linger=0)

    async def _hello(self, address: str) -> m.HelloReply:
        while not isinstance(reply := await self._ask(address, m.Hello()), m.HelloReply):
            log.info("cache node %s is not answering yet; its blocks are not indexed", address)
            await asyncio.sleep(RETRY_S)
        return reply

    async def _poll_stats(self, address: str, node_id: str) -> None:
        while True:
            if isinstance(reply := await self._ask(address, m.Stats()), m.StatsReply):
                try:
                    self.on_stats(node_id, reply.stats)
                except Exception:  # noqa: BLE001  odd counters cost this poll, not the next ones
                    log.exception("cache node %s sent stats the metrics could not take", node_id)
            await asyncio.sleep(STATS_INTERVAL_S)

    async def _watch(self, address: str) -> None:
        hello = await self._hello(address)
        self.node_ids[address] = hello.node_id
        if self.on_stats is not None:
            self._tasks.append(asyncio.create_task(self._poll_stats(address, hello.node_id)))
        sub = security.client(self.ctx.socket(zmq.SUB))
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(hello.events_address)
        log.info("indexing cache node %s (%s) from %s", hello.node_id, address, hello.events_address)
        try:
            while True:
                try:
                    msg = m.decode(await sub.recv())
                except m.MessageError as exc:
                    log.warning("cache node %s sent a malformed event batch: %s", hello.node_id, exc)
                    continue
                if not isinstance(msg, m.StoreEvents) or msg.node_id != hello.node_id:
                    log.warning("cache node %s published something other than its own events", hello.node_id)
                    continue
                for kind, key, _tier in msg.events:
                    (self.index.add if kind == "add" else self.index.remove)(hello.node_id, (key,))
        finally:
            sub.close(linger=0)

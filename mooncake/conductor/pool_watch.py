"""Feeds the global prefix index from the cache nodes, and tells it the truth when they fail.

For each node: ask where it publishes (retrying until it answers), subscribe, take a snapshot of every
key it holds (SSD-recovered blocks included), then apply its numbered event batches on top. A gap in the
numbers or a new epoch (the node restarted) means events were missed: take a snapshot again. A node that
closes its connection (its process died) is down; one that publishes nothing for LIVENESS_S is asked for
its stats, and one that does not answer within the timeout (hung, cut off) is down too: its blocks leave
the index at once (so no request is planned to read them) and it is looked for again until it answers.
Also polls each live node's counters for the conductor's /metrics."""

import asyncio
import logging

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from mooncake import messages as m
from mooncake import security
from mooncake.conductor.prefix_index import PrefixIndex
from mooncake.runtime import Supervisor

log = logging.getLogger(__name__)

RETRY_S = 1.0
STATS_INTERVAL_S = 2.0
LIVENESS_S = 1.0  # quiet this long: ask the node whether it is still there
SUBSCRIBE_SETTLE_S = 0.2  # a new SUB socket misses what is published before its subscription lands


class PoolWatcher:
    def __init__(self, nodes: tuple[str, ...], index: PrefixIndex, timeout_s: float, on_stats=None):
        self.nodes = nodes
        self.on_stats = on_stats  # called with (node id, stats dict) every STATS_INTERVAL_S
        self.index = index
        self.timeout_s = timeout_s
        self.ctx = zmq.asyncio.Context()
        self.node_ids: dict[str, str] = {}  # control address -> node id, while it is up
        self.num_resyncs = 0
        self._tasks: list[asyncio.Task] = []

    @property
    def live_ids(self) -> frozenset[str]:
        return frozenset(self.node_ids.values())

    def start(self, supervisor: Supervisor | None = None) -> None:
        """Watch every node. Under a `supervisor` (the conductor's) a watch that ends by an exception ends
        the process: an index that silently stopped following a node would plan reads of blocks it lost."""
        def spawn(coro, what):
            return asyncio.create_task(coro) if supervisor is None else supervisor.spawn(coro, what)
        self._tasks = [spawn(self._watch(address), f"the watch of cache node {address}") for address in self.nodes]
        if self.on_stats is not None:
            self._tasks.append(spawn(self._poll_stats(), "the cache nodes' stats poll"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.ctx.destroy(linger=0)

    async def _ask(self, address: str, request):
        """One request/reply with a node on a fresh socket (so a late reply never answers the next
        question); None if it did not answer in time."""
        sock = security.client(self.ctx.socket(zmq.DEALER), server="cache")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        try:
            await sock.send(m.encode(request))
            return m.decode(await asyncio.wait_for(sock.recv(), self.timeout_s))
        except (asyncio.TimeoutError, m.MessageError):
            return None
        finally:
            sock.close(linger=0)

    async def _poll_stats(self) -> None:
        while True:
            for address, node_id in list(self.node_ids.items()):
                if isinstance(reply := await self._ask(address, m.Stats()), m.StatsReply):
                    try:
                        self.on_stats(node_id, reply.stats)
                    except Exception:  # noqa: BLE001  odd counters cost this poll, not the next ones
                        log.exception("cache node %s sent stats the metrics could not take", node_id)
            await asyncio.sleep(STATS_INTERVAL_S)

    async def _watch(self, address: str) -> None:
        is_first = True
        while True:
            hello = await self._ask(address, m.Hello())
            if not isinstance(hello, m.HelloReply):
                if is_first:
                    log.info("cache node %s is not answering yet; its blocks are not indexed", address)
                    is_first = False
                await asyncio.sleep(RETRY_S)
                continue
            is_first = True
            sub = security.client(self.ctx.socket(zmq.SUB), server="cache")
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)  # a node that dies closes its connection
            sub.connect(hello.events_address)
            try:
                why = await self._follow(address, hello, sub, monitor)
            finally:
                sub.disable_monitor()
                monitor.close(linger=0)
                sub.close(linger=0)
                self.node_ids.pop(address, None)
                self.index.drop_holder(hello.node_id)
            log.error("cache node %s (%s) %s: its blocks left the prefix index; looking for it again",
                      hello.node_id, address, why)

    async def _snapshot(self, address: str, node_id: str) -> m.SnapshotReply | None:
        reply = await self._ask(address, m.Snapshot())
        if not isinstance(reply, m.SnapshotReply) or reply.node_id != node_id:
            return None
        self.index.drop_holder(node_id)
        self.index.add(node_id, reply.keys)
        return reply

    async def _follow(self, address: str, hello: m.HelloReply, sub, monitor) -> str:
        """Index the node until it fails; returns how it failed."""
        node_id = hello.node_id
        await asyncio.sleep(SUBSCRIBE_SETTLE_S)
        if (snap := await self._snapshot(address, node_id)) is None:
            return "did not answer a snapshot request"
        epoch, seq = snap.epoch, snap.seq
        self.node_ids[address] = node_id
        log.info("indexing cache node %s (%s): %d blocks at event %d, then events from %s", node_id, address,
                 len(snap.keys), seq, hello.events_address)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            ready = dict(await poller.poll(LIVENESS_S * 1000))
            if monitor in ready:
                if parse_monitor_message(await monitor.recv_multipart())["event"] == zmq.EVENT_DISCONNECTED:
                    return "closed its connection"
                continue
            if sub not in ready:
                if not isinstance(await self._ask(address, m.Stats()), m.StatsReply):
                    return f"stopped answering (nothing within {self.timeout_s:g} s)"
                continue
            frame = await sub.recv()
            try:
                msg = m.decode(frame)
            except m.MessageError as exc:
                log.warning("cache node %s sent a malformed event batch: %s", node_id, exc)
                continue
            if not isinstance(msg, m.StoreEvents) or msg.node_id != node_id:
                log.warning("cache node %s published something other than its own events", node_id)
                continue
            if msg.epoch == epoch and msg.seq <= seq:
                continue  # in the snapshot already
            if msg.epoch != epoch or msg.seq != seq + 1:
                self.num_resyncs += 1
                log.warning("cache node %s: event %s:%d after %s:%d (%s); taking a snapshot", node_id, msg.epoch[:8],
                            msg.seq, epoch[:8], seq, "it restarted" if msg.epoch != epoch else "missed events")
                if (snap := await self._snapshot(address, node_id)) is None:
                    return "did not answer a snapshot request"
                epoch, seq = snap.epoch, snap.seq
                continue
            seq = msg.seq
            for kind, key, _tier in msg.events:
                (self.index.add if kind == "add" else self.index.remove)(node_id, (key,))

"""Async client of the cache nodes, for the prefill and decode roles: `put_blocks`, `get_blocks`,
`match_prefix`. Each block's replicas live on the `replica_num` nodes that rank highest for its key by
rendezvous hashing, so every client agrees where a key lives without asking; a read tries those nodes
in order and then the rest, so a block stays readable while any replica lives.

A node that fails a call (no answer within `cache_client.timeout_s`, a transfer error) or closes its
connection (its process died) is down at once:
calls skip it (a circuit breaker: they fail fast instead of waiting out the timeout again) until a
background probe hears it answer `Hello` again, with its possibly new data address. A node that was down
when the client started is probed the same way."""

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

import xxhash
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from mooncake import messages as m
from mooncake import security
from mooncake.config import CacheClientConfig
from mooncake.registry import load_backend
from mooncake.runtime import Supervisor
from mooncake.transfer.contract import TransferError, Transport, owned_bytes

log = logging.getLogger(__name__)


PROBE_MIN_S, PROBE_MAX_S = 0.5, 10.0  # a down node is asked again after this, doubling up to the max


@dataclass
class _Node:
    control_address: str
    socket: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket  # the socket's connection events: a node that dies closes its connection
    lock: asyncio.Lock
    hello: m.HelloReply | None = None  # None while down
    probe_s: float = PROBE_MIN_S  # wait before the next probe while down
    next_probe_s: float = 0.0

    @property
    def is_up(self) -> bool:
        return self.hello is not None


class CacheClient:
    def __init__(self, config: CacheClientConfig, make_transport: Callable[[str], Transport] | None = None,
                 supervisor: Supervisor | None = None):
        self.config = config
        # NOTE: a role's supervisor: a probe or watch loop that ends by an exception ends the process, rather than
        # leaving a client that never sees a node come back or go away.
        self.supervisor = supervisor
        # How to build the transport a node names (its [transport] settings); default: the backend as is.
        self.make_transport = make_transport or (lambda name: load_backend("transports", name)())
        self.ctx = zmq.asyncio.Context()
        self.nodes: list[_Node] = []
        self.transports: dict[str, object] = {}
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """Connect to every node; those that do not answer now are probed until they do."""
        if not self.config.nodes:
            raise TransferError("no cache nodes configured (cache_client.nodes is empty)")
        for address in self.config.nodes:
            self.nodes.append(_Node(address, *self._connect(address), asyncio.Lock()))
        await asyncio.gather(*(self._hello(node) for node in self.nodes))
        loops = [(self._probe_down_nodes(), "the cache client's probe of down nodes"),
                 (self._watch_connections(), "the cache client's connection watch")]
        self._tasks = [asyncio.create_task(coro) if self.supervisor is None else self.supervisor.spawn(coro, what)
                       for coro, what in loops]

    def _connect(self, address: str) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        sock = security.client(self.ctx.socket(zmq.DEALER), server="cache")
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(address)
        return sock, monitor

    def _reconnect(self, node: _Node) -> None:
        """A fresh socket: the old one may hold a late reply that would answer the next question."""
        node.socket.disable_monitor()
        node.monitor.close(linger=0)
        node.socket.close(linger=0)
        node.socket, node.monitor = self._connect(node.control_address)

    async def _hello(self, node: _Node) -> bool:
        try:
            reply = await self._call(node, m.Hello())
            if reply.transport not in self.transports:
                transport = self.make_transport(reply.transport)
                await transport.start()
                self.transports[reply.transport] = transport
        except TransferError as exc:
            self._down(node, str(exc))
            return False
        if node.hello is None and node.next_probe_s:
            log.info("cache node %s (%s) is back", reply.node_id, node.control_address)
        node.hello, node.probe_s = reply, PROBE_MIN_S
        return True

    def _down(self, node: _Node, why: str) -> None:
        """Skip the node from now on until a probe hears it again."""
        loop_s = asyncio.get_running_loop().time()
        if node.hello is not None or not node.next_probe_s:
            log.warning("cache node %s is down (%s); not using it until it answers again", node.control_address, why)
        else:
            node.probe_s = min(PROBE_MAX_S, node.probe_s * 2)
        node.hello = None
        node.next_probe_s = loop_s + node.probe_s

    async def _probe_down_nodes(self) -> None:
        while True:
            await asyncio.sleep(PROBE_MIN_S / 2)
            now = asyncio.get_running_loop().time()
            due = [n for n in self.nodes if n.hello is None and n.next_probe_s <= now]
            if due:
                await asyncio.gather(*(self._hello(n) for n in due))

    async def _watch_connections(self) -> None:
        """A node whose process dies closes its connection: it is down now, not after a timeout."""
        while True:
            poller = zmq.asyncio.Poller()
            for node in self.nodes:
                poller.register(node.monitor, zmq.POLLIN)
            try:
                ready = dict(await poller.poll(PROBE_MIN_S * 1000))  # then again: sockets may be replaced
                for node in self.nodes:
                    if node.monitor in ready:
                        event = parse_monitor_message(await node.monitor.recv_multipart())
                        if event["event"] == zmq.EVENT_DISCONNECTED and node.is_up:
                            self._down(node, "it closed its connection")
            except zmq.ZMQError:  # a monitor closed under the poll (its socket was replaced): poll anew
                continue

    async def _call(self, node: _Node, request):
        """One request/reply on a node's control socket, within the deadline."""
        async with node.lock:
            try:
                await asyncio.wait_for(node.socket.send(m.encode(request)), self.config.timeout_s)
                reply = m.decode(await asyncio.wait_for(node.socket.recv(), self.config.timeout_s))
            except asyncio.TimeoutError:
                self._reconnect(node)
                raise TransferError(f"cache node {node.control_address}: no answer to {request.TAG!r} within "
                                    f"{self.config.timeout_s:g} s") from None
        if isinstance(reply, m.ErrorReply):
            raise TransferError(f"cache node {node.control_address} refused {request.TAG!r}: {reply.error}")
        return reply

    def ranked_nodes(self, key: int) -> list[_Node]:
        """Every node, best home for `key` first (rendezvous hashing on the node's control address)."""
        def score(node):
            return xxhash.xxh3_64_intdigest(key.to_bytes(8, "little") + node.control_address.encode())
        return sorted(self.nodes, key=score, reverse=True)

    async def put_blocks(self, blocks: list[tuple[int, bytes]], self_checked: bool = False) -> dict[int, str | None]:
        """Write each block to its replicas; per key, None if at least one replica took it, else why not.
        `self_checked`: the blocks carry their own check (encoded KVPayloads), so neither the transport
        nor the node hashes them, and readers get them unverified for their consumer to check."""
        plan: dict[int, list[tuple[int, bytes]]] = {}
        for key, data in blocks:
            for node in self.ranked_nodes(key)[:self.config.replica_num]:
                plan.setdefault(id(node), []).append((key, data))
        by_id = {id(n): n for n in self.nodes}
        outcomes = await _all([self._send(by_id[i], group, self_checked) for i, group in plan.items()])
        stored, errors = set(), {key: [] for key, _ in blocks}
        for outcome in outcomes:
            for key, error in outcome.items():
                if error is None:
                    stored.add(key)
                else:
                    errors[key].append(error)
        return {key: None if key in stored else "; ".join(errors[key]) or "no replica reachable"
                for key, _ in blocks}

    async def _send(self, node: _Node, blocks, self_checked: bool) -> dict[int, str | None]:
        if not node.is_up:
            return {key: f"cache node {node.control_address} is down" for key, _ in blocks}
        transport = self.transports[node.hello.transport]
        try:
            result = await transport.send(node.hello.data_address, blocks, self.config.timeout_s,
                                          self_checked=self_checked)
        except TransferError as exc:
            self._down(node, str(exc))
            return {key: str(exc) for key, _ in blocks}
        return {b.key: b.error for b in result.blocks}

    async def get_blocks(self, keys: list[int]) -> dict[int, bytes | memoryview | None]:
        """Each key's bytes, or None where no live node holds it. Bytes are verified by the transport
        unless they were put `self_checked` (their consumer checks those)."""
        found: dict[int, bytes | None] = {key: None for key in keys}
        candidates = {key: [n for n in self.ranked_nodes(key) if n.is_up] for key in keys}
        pending = list(dict.fromkeys(keys))
        while pending:
            plan: dict[int, list[int]] = {}
            for key in pending:
                if candidates[key]:
                    plan.setdefault(id(candidates[key].pop(0)), []).append(key)
            if not plan:
                break
            by_id = {id(n): n for n in self.nodes}
            outcomes = await _all([self._fetch(by_id[i], group) for i, group in plan.items()])
            for outcome in outcomes:
                found.update({k: v for k, v in outcome.items() if v is not None})
            pending = [key for key in pending if found[key] is None and candidates[key]]
        return found

    async def _fetch(self, node: _Node, keys: list[int]) -> dict[int, bytes | None]:
        if not node.is_up:  # it went down since the plan was made
            return {}
        transport = self.transports[node.hello.transport]
        try:
            result = await transport.fetch(node.hello.data_address, keys, self.config.timeout_s)
        except TransferError as exc:
            self._down(node, str(exc))
            return {}
        return {b.key: (owned_bytes(b.data) if b.ok else None) for b in result.blocks}

    async def match_prefix(self, keys: list[int]) -> int:
        """How many leading `keys` the live nodes hold between them."""
        live = [n for n in self.nodes if n.is_up]
        replies = await asyncio.gather(*(self._call(n, m.Exists(keys=list(keys))) for n in live),
                                       return_exceptions=True)
        for node, reply in zip(live, replies):
            if isinstance(reply, TransferError):
                self._down(node, str(reply))
        held = [False] * len(keys)
        for reply in replies:
            if isinstance(reply, m.ExistsReply):
                held = [h or t is not None for h, t in zip(held, reply.tiers)]
        return next((i for i, h in enumerate(held) if not h), len(keys))

    async def remove_blocks(self, keys: list[int]) -> int:
        """Remove `keys` from every live node (a block its reader found corrupted, say); how many copies
        went. A node that does not answer is marked down, as for any call."""
        live = [n for n in self.nodes if n.is_up]
        replies = await asyncio.gather(*(self._call(n, m.Remove(keys=list(keys))) for n in live),
                                       return_exceptions=True)
        for node, reply in zip(live, replies):
            if isinstance(reply, TransferError):
                self._down(node, str(reply))
        return sum(sum(r.removed) for r in replies if isinstance(r, m.RemoveReply))

    async def stats(self) -> dict[str, dict]:
        """Each live node's counters (hits, misses, bytes, evictions, transfer rates), by control address."""
        live = [n for n in self.nodes if n.is_up]
        replies = await asyncio.gather(*(self._call(n, m.Stats()) for n in live))
        return {n.control_address: r.stats for n, r in zip(live, replies)}

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for transport in self.transports.values():
            await transport.stop()
        for node in self.nodes:
            node.socket.disable_monitor()
            node.monitor.close(linger=0)
            node.socket.close(linger=0)
        self.ctx.term()


async def _all(calls: list) -> list:
    """Results of the calls, run together; one call runs on its own (no task to schedule)."""
    if len(calls) == 1:
        return [await calls[0]]
    return await asyncio.gather(*calls)

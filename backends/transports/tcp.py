"""TCP transport over ZeroMQ: a ROUTER socket serves, one DEALER socket per peer sends; blocks travel
as zero-copy frames, many per message, and several requests may be in flight per peer (replies are
matched by request id). A peer that does not answer by the deadline is a TransferError naming it."""

import asyncio
import itertools
import logging
import os
import time
from contextlib import contextmanager

import msgpack
import zmq
import zmq.asyncio

from mooncake import security
from mooncake.addresses import advertised
from mooncake.transfer.contract import BlockResult, BlockService, TransferError, TransferResult, Transport, \
    new_request_id
from mooncake.transfer.framing import REPLY, ReplayGuard, Tamper, binding, block_frames, is_sealed_for, \
    pack_header, seal_for, self_checked_sums, unpack_header, verify_blocks

log = logging.getLogger(__name__)

# The hot path calls the methods of pyzmq's compiled socket class with plain-int flags: its Python layer
# (flag enums, per-call argument checks) costs about 10 us a message, a tenth of a loopback round trip.
_EVENTS, _POLLIN, _NOBLOCK, _SNDMORE = (int(c) for c in (zmq.EVENTS, zmq.POLLIN, zmq.NOBLOCK, zmq.SNDMORE))
_get, _send, _recv = zmq.backend.Socket.get, zmq.backend.Socket.send, zmq.backend.Socket.recv


def _readable(sock: zmq.Socket) -> bool:
    return not sock.closed and _get(sock, _EVENTS) & _POLLIN


def _send_frames(sock: zmq.Socket, frames: list) -> None:
    """Queue one multipart message without blocking (zmq.Again when the queue is full: libzmq takes a
    message's first part only if it will take them all). Frames of 64 KiB or more go zero-copy (pyzmq's
    copy_threshold)."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        _send(sock, frame, _NOBLOCK | _SNDMORE if i < last else _NOBLOCK, copy=False)


def _recv_frames(sock: zmq.Socket) -> list[zmq.Frame]:
    """One whole multipart message, zero-copy (the caller has seen the socket readable)."""
    frames = [_recv(sock, _NOBLOCK, copy=False)]
    while frames[-1].more:
        frames.append(_recv(sock, _NOBLOCK, copy=False))
    return frames


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, tamper: Tamper = None, host: str = "127.0.0.1"):
        self.tamper = tamper
        self.host = host
        self.ctx = zmq.asyncio.Context()
        self.service: BlockService | None = None
        self.address: str | None = None
        self._server: zmq.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._peers: dict[str, zmq.Socket] = {}
        self._pending: dict[str, asyncio.Future] = {}
        self.refused = 0  # messages without the cluster's MAC for this endpoint, or replayed: ignored
        self.sender_id = os.urandom(8)  # this endpoint, in the binding of every message it sends
        self._counters: dict[str, itertools.count] = {}  # per peer: the counter of the next message
        self._guard = ReplayGuard()
        # What this endpoint served, per op: requests, block bytes, seconds spent handling them.
        self.served = {op: {"requests": 0, "bytes": 0, "seconds": 0.0} for op in ("put", "get")}

    async def start(self, service=None, address=None) -> str:
        self.service = service
        if service is not None:
            self._guard = ReplayGuard()  # NOTE: from now: whatever was sealed before this start is not new
            # A plain (not asyncio) socket read from a loop reader callback: handling a request is
            # synchronous anyway, and this skips a future and a task wake-up per message.
            self._server = security.server(zmq.Socket(zmq.Context.shadow(self.ctx.underlying), zmq.ROUTER),
                                           security.DATA_MAX_BYTES, curve=False)  # sealed messages instead
            self._server.setsockopt(zmq.LINGER, 0)
            try:
                self._server.bind(address or f"tcp://{self.host}:*")
            except zmq.ZMQError as exc:
                self._server.close(linger=0)
                self._server = None
                raise TransferError(f"{self.name} transport cannot listen on {address}: {exc}") from None
            # NOTE: peers get a reachable address: a wildcard bind is advertised as this endpoint's host.
            self.address = advertised(self._server.getsockopt_string(zmq.LAST_ENDPOINT), self.host)
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._server.getsockopt(zmq.FD), self._serve)
            self._loop.call_soon(self._serve)  # anything that came before the reader was added
        return self.address or ""

    # -- serving ----------------------------------------------------------------------------------

    SERVE_BATCH = 64  # requests handled per loop callback before other tasks get a turn

    def _serve(self) -> None:
        """Handle every request waiting on the server socket. ZeroMQ's FD is edge-triggered: it signals
        a change, not readiness, so drain until EVENTS shows nothing left (a send can consume the edge,
        hence the check after each reply)."""
        server = self._server
        for _ in range(self.SERVE_BATCH):
            if server is None or not _readable(server):
                return
            identity, *frames = _recv_frames(server)
            # NOTE: not from the cluster, not for this endpoint, or seen before: no reply, no effect.
            if not _is_sealed(frames, self.address) or (why := self._guard.admit(frames[1].buffer)):
                self._refuse(why if _is_sealed(frames, self.address) else "not sealed for this endpoint")
                continue
            frames = frames[2:]
            try:
                reply = self._handle(frames)
            except Exception as exc:  # noqa: BLE001  a bad peer must not take the endpoint down
                log.warning("%s transport %s: bad request from a peer: %s", self.name, self.address, exc)
                reply = [pack_header("error", _request_id_of(frames), error=f"malformed request: {exc}")]
            if reply:  # one-way notices (release) get no reply; a ROUTER send never blocks
                bind = binding(self.sender_id, 0)  # NOTE: a reply is matched to its request id, once
                _send_frames(server, [identity, seal_for(bind, REPLY + self.address, reply[0]), bind, *reply])
        self._loop.call_soon(self._serve)  # more may be waiting: continue after other callbacks

    def _refuse(self, why: str) -> None:
        self.refused += 1
        if self.refused == 1 or self.refused % 1000 == 0:
            log.warning("%s transport %s: ignored %d messages not sealed with the cluster key for this endpoint, or "
                        "replayed (the last: %s)", self.name, self.address, self.refused, why)

    def _handle(self, frames) -> list:
        header = unpack_header(frames[0].buffer)
        request_id, data = header["id"], [f.buffer for f in frames[1:]]
        if header["op"] in self.served:
            start = time.perf_counter()
            num_bytes, reply = self._serve_blocks(header, request_id, data)
            served = self.served[header["op"]]
            served["requests"] += 1
            served["bytes"] += num_bytes
            served["seconds"] += time.perf_counter() - start
            return reply
        if header["op"] == "release":
            self._released(header)
            return []
        return self._handle_op(header, request_id, data)

    def _handle_op(self, header: dict, request_id: str, data: list) -> list:
        """Ops of a subclass's own (shm's write windows); reply frames, or [] for a one-way notice."""
        raise ValueError(f"unknown op {header['op']!r}")

    def _serve_blocks(self, header: dict, request_id: str, data: list) -> tuple[int, list]:
        """A put or get from a peer: (block bytes moved, reply frames)."""
        if header["op"] == "put":
            with self._incoming(header, data) as blocks:
                if len(blocks) != len(header["keys"]):
                    raise ValueError(f"{len(header['keys'])} keys but {len(blocks)} blocks of data")
                digests = None
                if self.service.keeps_blocks:  # it keeps what it gets: hand it its own
                    blocks, digests = self._kept(blocks, header["sums"])
                errors = []
                verified = verify_blocks(header["keys"], header["sums"], blocks, digests)
                for block, digest in zip(verified, header["sums"]):
                    if not block.ok:
                        errors.append(block.error)
                    else:
                        errors.append(self.service.put_block(block.key, block.data, digest))
                num_bytes = sum(len(b) for b in blocks)
            return num_bytes, [pack_header("put-reply", request_id, errors=errors)]
        if self.service.locates_blocks:
            located = [(k, loc) for k in header["keys"] if (loc := self.service.locate_block(k)) is not None]
            fields, frames_out = self._outgoing_located(located, request_id)
            num_bytes = sum(len(memoryview(loc.data).cast("B")) for _, loc in located)
        else:
            found = [(k, d) for k in header["keys"] if (d := self.service.get_block(k)) is not None]
            fields, frames_out = self._outgoing(found, request_id)
            num_bytes = sum(len(memoryview(d).cast("B")) for _, d in found)
        return num_bytes, [pack_header("get-reply", request_id, **fields), *frames_out]

    def _released(self, header: dict) -> None:
        """A peer has read a fetch reply; staged transports free it (plain tcp has nothing to free)."""

    # How block bytes travel; shm.py overrides these two to move them through shared memory.

    def _outgoing(self, blocks, request_id: str, sums: list[int] | None = None) -> tuple[dict, list]:
        """Header fields and frames carrying `blocks`; `sums`, where given, their checksums already known
        (or a payload's bound digest), else they are hashed here."""
        keys, sizes, sums, frames = block_frames(blocks, self.tamper, sums)
        return {"keys": keys, "sums": sums}, frames

    def _outgoing_located(self, located: list, request_id: str) -> tuple[dict, list]:
        """Like `_outgoing`, for blocks whose checksum the service already knows: no hashing here."""
        if self.tamper:
            return self._outgoing([(k, loc.data) for k, loc in located], request_id,
                                  [loc.checksum for _, loc in located])
        views = [memoryview(loc.data).cast("B") for _, loc in located]
        return {"keys": [k for k, _ in located], "sums": [loc.checksum for _, loc in located]}, views

    @contextmanager
    def _incoming(self, header: dict, frames: list):
        """The blocks' bytes, in the header's key order, valid inside the `with`."""
        yield frames

    def _kept(self, blocks: list, sums: list[int]) -> tuple[list, list]:
        """Received blocks the receiver may keep (a fetch's results, or a put for a service that keeps
        blocks), and their checksums where already computed (None: the verifier hashes it); `sums` are
        the sender's (negative: a payload's bound digest, not hashed). A ZeroMQ frame is already the receiver's own."""
        return blocks, [None] * len(blocks)

    # -- client side ------------------------------------------------------------------------------

    def _socket(self, peer: str) -> zmq.Socket:
        """This endpoint's DEALER to `peer`: a plain socket whose replies a loop reader callback reads."""
        if peer not in self._peers:
            sock = security.client(zmq.Socket(zmq.Context.shadow(self.ctx.underlying), zmq.DEALER),
                                   security.DATA_MAX_BYTES, curve=False)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(peer)
            self._loop = self._loop or asyncio.get_running_loop()
            self._loop.add_reader(sock.getsockopt(zmq.FD), self._receive, peer, sock)
            self._peers[peer] = sock
        return self._peers[peer]

    def _receive(self, peer: str, sock: zmq.Socket) -> None:
        """Hand every waiting reply to its request (drained until EVENTS shows none: see `_serve`)."""
        while _readable(sock):
            frames = _recv_frames(sock)
            if not _is_sealed(frames, REPLY + peer):
                log.warning("%s transport: dropped a reply from %s that is not sealed with the cluster key",
                            self.name, peer)
                continue
            frames = frames[2:]
            try:
                header = unpack_header(frames[0].buffer)
            except ValueError as exc:
                log.warning("tcp transport: malformed reply from %s: %s", peer, exc)
                continue
            future = self._pending.pop(header.get("id", ""), None)
            if future is not None and not future.done():  # late replies after a deadline are dropped
                future.set_result((header, [f.buffer for f in frames[1:]]))

    def _notify(self, peer: str, frames: list) -> None:
        """Queue a one-way notice (release, close-window) to `peer`. Each has a fallback on the peer's
        side (a TTL), so a notice that meets a full queue is dropped rather than waited on."""
        try:
            self._queue(peer, frames)
        except zmq.Again:
            log.debug("%s transport: queue to %s full; notice %r dropped", self.name, peer, frames[0][:40])

    def _queue(self, peer: str, frames: list) -> None:
        """Queue a message to `peer` (zmq.Again when its queue is full). A DEALER queues even before the
        peer is up, so only a full queue (high-water mark) can refuse it."""
        sock = self._socket(peer)
        counter = self._counters.setdefault(peer, itertools.count(1))
        bind = binding(self.sender_id, next(counter))
        _send_frames(sock, [seal_for(bind, peer, frames[0]), bind, *frames])
        if _readable(sock):  # a send can consume the FD's edge: look now
            self._loop.call_soon(self._receive, peer, sock)

    async def _request(self, peer, request_id, frames, timeout_s):
        """Send a request and wait for its reply, all within `timeout_s`. The deadline is a timer that
        resolves the reply's future with None: no timeout scope, no task cancellation on the hot path."""
        if request_id in self._pending:  # replies are matched by id: a duplicate would steal the reply
            raise TransferError(f"transfer {request_id} to {peer}: a transfer with this id is already in flight")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending[request_id] = future
        deadline = loop.time() + timeout_s
        timer = loop.call_at(deadline, _expire, future)
        try:
            while True:
                try:
                    self._queue(peer, frames)
                    break
                except zmq.Again:  # the queue to this peer is full: wait, within the deadline
                    if loop.time() >= deadline:
                        break
                    await asyncio.sleep(0.001)
            reply = await future
        finally:
            timer.cancel()
            self._pending.pop(request_id, None)
        if reply is None:
            raise TransferError(f"transfer {request_id} to {peer}: no answer within {timeout_s:g} s "
                                f"(peer down or overloaded)")
        header, data = reply
        if header["op"] == "error":
            raise TransferError(f"transfer {request_id} to {peer}: peer refused it: {header.get('error')}")
        return header, data

    async def send(self, peer, blocks, timeout_s, request_id=None, self_checked=False) -> TransferResult:
        request_id = request_id or new_request_id()
        start = time.perf_counter()
        fields, frames = self._outgoing(blocks, request_id, self_checked_sums(blocks, self_checked))
        try:
            header, _ = await self._request(peer, request_id, [pack_header("put", request_id, **fields), *frames],
                                            timeout_s)
        finally:
            self._sent(fields)
        results = [BlockResult(k, error=e) for k, e in zip(fields["keys"], header["errors"])]
        num_bytes = sum(len(memoryview(d).cast("B")) for _, d in blocks)
        return TransferResult(peer, request_id, results, num_bytes, time.perf_counter() - start)

    async def fetch(self, peer, keys, timeout_s, request_id=None) -> TransferResult:
        request_id = request_id or new_request_id()
        start = time.perf_counter()
        header, data = await self._request(peer, request_id, [pack_header("get", request_id, keys=keys)],
                                           timeout_s)
        with self._incoming(header, data) as views:
            blocks, digests = self._kept(views, header["sums"])
        if "staged" in header:  # tell the peer its staged reply may be reused; no answer expected
            self._notify(peer, [pack_header("release", request_id, staged=header["staged"])])
        by_key = {k: (s, b, d) for k, s, b, d in zip(header["keys"], header["sums"], blocks, digests)}
        sums, frames, known = zip(*(by_key.get(k, (None, b"", None)) for k in keys)) if keys else ((), (), ())
        results = verify_blocks(keys, sums, frames, known)
        num_bytes = sum(len(b) for b in blocks)
        return TransferResult(peer, request_id, results, num_bytes, time.perf_counter() - start)

    def _sent(self, fields: dict) -> None:
        """Called once a send's reply is in (or it failed): free what `_outgoing` made."""

    async def stop(self) -> None:
        for sock in self._peers.values():
            self._loop.remove_reader(sock.getsockopt(zmq.FD))
            sock.close(linger=0)
        if self._server is not None:
            self._loop.remove_reader(self._server.getsockopt(zmq.FD))
            self._server.close(linger=0)
        self._peers.clear()
        security.release(self.ctx)  # its ZAP handler (data sockets' password check), if it has one
        self.ctx.term()


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _is_sealed(frames: list[zmq.Frame], receiver: str) -> bool:
    """A message is [MAC, binding, header, blocks...]: is its MAC right for `receiver` (always, without keys)?"""
    return len(frames) >= 3 and is_sealed_for(frames[0].buffer, frames[1].buffer, receiver, frames[2].buffer)


def _request_id_of(frames) -> str:
    """The request id of a message we could not handle, if its header at least parses (of any version)."""
    try:
        header = msgpack.unpackb(bytes(frames[0].buffer))
    except (ValueError, IndexError, TypeError, msgpack.UnpackException):
        return ""
    return str(header.get("id", "")) if isinstance(header, dict) else ""

"""Where an instance sends a request's reports (PrefillDone, Tokens, RequestFailed): straight to the API
process that owns the request (the `reply_to` its Prefill, PrefillStage or Decode named), over one
DEALER per API process (identity = instance id), so the conductor never relays a token (DESIGN section 13).
A request that names no API process reports to the conductor. An API process answers a report of a
request it no longer holds with `Cancel`, which goes to `on_message` like the conductor's."""

import asyncio
import logging
from typing import Awaitable, Callable

import zmq
import zmq.asyncio

from mooncake import messages as m
from mooncake import security
from mooncake.runtime import Supervisor

log = logging.getLogger(__name__)

MAX_PENDING = 10_000  # messages queued for one API process that is away; past that, newer ones are dropped


class ReportLinks:
    def __init__(self, instance_id: str, fallback: Callable[[object], Awaitable[None]],
                 on_message: Callable[[object], Awaitable[None]], supervisor: Supervisor):
        self.instance_id = instance_id
        self.fallback = fallback  # the conductor link's send
        self.on_message = on_message
        self.supervisor = supervisor
        self.ctx = zmq.asyncio.Context()
        self.socks: dict[str, zmq.asyncio.Socket] = {}
        self.reply_to: dict[str, str] = {}  # request id -> its API process's report address
        self._tasks: list[asyncio.Task] = []

    def track(self, request_id: str, reply_to: str) -> None:
        if reply_to:
            self.reply_to[request_id] = reply_to

    def forget(self, request_id: str) -> None:
        self.reply_to.pop(request_id, None)

    async def send(self, request_id: str, msg) -> None:
        await self.send_to(self.reply_to.get(request_id, ""), msg)

    async def send_to(self, address: str, msg) -> None:
        if not address:
            await self.fallback(msg)
            return
        sock = self.socks.get(address) or self._connect(address)
        try:
            await sock.send(m.encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:  # NOTE: an API process away for long: its requests are lost with it anyway
            log.warning("%s: the API process at %s takes no reports; dropped %s", self.instance_id, address, msg.TAG)

    def _connect(self, address: str) -> zmq.asyncio.Socket:
        sock = security.client(self.ctx.socket(zmq.DEALER), server="api")
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, MAX_PENDING)
        sock.setsockopt(zmq.IDENTITY, self.instance_id.encode())
        sock.connect(address)
        self.socks[address] = sock
        self._tasks.append(self.supervisor.spawn(self._receive(address, sock), f"the report link to {address}"))
        return sock

    async def _receive(self, address: str, sock) -> None:
        while True:
            frame = await sock.recv()
            try:
                msg = m.decode(frame)
            except m.MessageError as exc:
                log.warning("%s: malformed message from the API process at %s: %s", self.instance_id, address, exc)
                continue
            if not isinstance(msg, m.Cancel):
                log.warning("%s: unexpected %s from the API process at %s", self.instance_id, msg.TAG, address)
                continue
            try:
                await self.on_message(msg)
            except Exception:  # noqa: BLE001  one bad message must not end the loop
                log.exception("handling a Cancel from %s failed", address)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for sock in self.socks.values():
            sock.close(linger=200)
        self.socks.clear()
        self.ctx.term()

"""A link to the conductor, for an instance or an API process: one DEALER socket (identity = its id) to the
conductor's ROUTER. Registers (retrying until the conductor answers, so it may start first or rejoin after
a conductor restart), heartbeats, sends, and hands every other message to `on_message`."""

import asyncio
import logging
from typing import Awaitable, Callable

import zmq
import zmq.asyncio

from mooncake import messages as m
from mooncake import security
from mooncake.errors import MooncakeError
from mooncake.runtime import Supervisor

log = logging.getLogger(__name__)

REGISTER_RETRY_S = 1.0


class ConductorLink:
    def __init__(self, address: str, register: m.Register, heartbeat: Callable[[], m.Heartbeat],
                 on_message: Callable[[object], Awaitable[None]], supervisor: Supervisor,
                 on_registered: Callable[[], None] = lambda: None, role: str | None = None,
                 registration: Callable[[], m.Register] | None = None):
        self.address = address
        self.register_msg = register
        self.registration = registration or (lambda: self.register_msg)  # what to register with, each time
        self.make_heartbeat = heartbeat
        self.on_message = on_message
        self.on_registered = on_registered  # the conductor (maybe a new one) knows nothing of us yet
        self.heartbeat_interval_s = 0.5
        self.registered = asyncio.Event()
        self.num_registrations = 0  # with this conductor or a later one
        self.supervisor = supervisor  # a refusal or a dead loop ends the instance through it
        self.ctx = zmq.asyncio.Context()
        self.sock = security.client(self.ctx.socket(zmq.DEALER), role=role)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, register.instance_id.encode())
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        # NOTE: with a standby conductor, one address per conductor: only the leader listens, and IMMEDIATE
        # queues messages only on a connection that is up, so they all go to whichever leads.
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        for address in self.address.split(","):
            self.sock.connect(address.strip())
        self._tasks = [self.supervisor.spawn(self._receive(), "the conductor link's receive loop"),
                       self.supervisor.spawn(self._register_and_beat(), "the heartbeat"),
                       asyncio.ensure_future(security.watch_handshakes(
                           self.sock, f"{self.register_msg.instance_id}: the conductor at {self.address} did not "
                           f"complete the CURVE handshake: this host's keys (security.keys_dir) are not that "
                           f"conductor's cluster's (`mooncake keys generate` makes one set for every host)"))]

    async def stop(self) -> None:
        if self.registered.is_set():
            # NOTE: say goodbye so the conductor stops placing work here now, not a heartbeat timeout later.
            try:
                await asyncio.wait_for(self.send(m.Leave(instance_id=self.register_msg.instance_id)), 1.0)
            except (asyncio.TimeoutError, zmq.ZMQError):
                pass
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.sock.close(linger=500)  # let the goodbye out
        self.ctx.term()

    async def send(self, msg) -> bool:
        """False when no conductor is connected (it is away): the message is dropped, never queued for a
        conductor that may not know what it refers to when it comes."""
        try:
            await self.sock.send(m.encode(msg), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            log.debug("%s: no conductor connected; %s dropped", self.register_msg.instance_id, msg.TAG)
            return False

    async def _register_and_beat(self) -> None:
        name = self.register_msg.instance_id
        while True:
            if not self.registered.is_set():
                await self.send(self.registration())
                try:
                    await asyncio.wait_for(self.registered.wait(), REGISTER_RETRY_S)
                    log.info("%s: registered with the conductor at %s", name, self.address)
                except asyncio.TimeoutError:
                    log.info("%s: waiting for the conductor at %s", name, self.address)
                continue
            await self.send(self.make_heartbeat())
            await asyncio.sleep(self.heartbeat_interval_s)

    async def _receive(self) -> None:
        while True:
            frame = await self.sock.recv()
            try:
                msg = m.decode(frame)
            except m.MessageError as exc:
                log.warning("malformed message from the conductor: %s", exc)
                continue
            if isinstance(msg, m.RegisterReply):
                if not msg.accepted:
                    # NOTE: a conductor that forgot us (it restarted) says so; anything else is fatal.
                    if msg.error == "unregistered":
                        self.registered.clear()
                        continue
                    self.supervisor.fail(MooncakeError(
                        f"the conductor at {self.address} refused {self.register_msg.instance_id}: {msg.error}"))
                    return
                self.heartbeat_interval_s = msg.heartbeat_interval_s
                if not self.registered.is_set():
                    self.num_registrations += 1
                    self.registered.set()
                    self.on_registered()
                continue
            if isinstance(msg, m.ErrorReply):
                log.warning("%s: the conductor at %s says: %s", self.register_msg.instance_id, self.address, msg.error)
                continue
            try:
                await self.on_message(msg)
            except Exception:  # noqa: BLE001  one bad message must not take the instance down
                log.exception("handling %s failed", type(msg).__name__)

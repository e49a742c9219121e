"""An API process's report socket: one ROUTER that prefill and decode instances send this process's
requests' reports to (PrefillDone, Tokens, StepTokens, RequestFailed), each from its own DEALER whose
identity is its instance id. `route(report, sender, key_role)` gets each report with the role of the key
its connection holds (None without keys) and may answer it (a `Cancel` for a leg this process no longer
holds), which goes back to the instance that sent it."""

import asyncio
import logging
from typing import Callable

import zmq
import zmq.asyncio

from mooncake import messages as m
from mooncake import security
from mooncake.addresses import advertised
from mooncake.errors import MooncakeError
from mooncake.runtime import Supervisor

log = logging.getLogger(__name__)

REPORTS = (m.PrefillDone, m.Tokens, m.RequestFailed)


class ReportInbox:
    def __init__(self, bind_address: str, host: str, route: Callable[[object, str, str | None], object]):
        self.bind_address = bind_address
        self.host = host  # the host put in the address instances are told
        self.route = route
        self.address = ""  # where instances reach it (what Place and Decode carry as reply_to)
        self.ctx: zmq.asyncio.Context | None = None
        self.sock = None

    async def start(self, supervisor: Supervisor) -> str:
        self.ctx = zmq.asyncio.Context()
        self.sock = security.server(self.ctx.socket(zmq.ROUTER), role="api")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self.sock.bind(self.bind_address)
        except zmq.ZMQError as exc:
            await self.stop()
            raise MooncakeError(f"API process: cannot listen for reports on api.report_address = "
                                f"{self.bind_address}: {exc}") from None
        self.address = advertised(self.sock.getsockopt(zmq.LAST_ENDPOINT).decode(), self.host)
        supervisor.spawn(self._receive(), "the report socket's receive loop")
        return self.address

    async def stop(self) -> None:
        if self.ctx is not None:
            self.sock.close(linger=0)
            security.release(self.ctx)
            self.ctx.term()
            self.ctx = None

    async def send(self, instance_id: str, msg) -> bool:
        """To an instance that has reported here (its connection is known); False if it is not connected."""
        try:
            await self.sock.send_multipart([instance_id.encode(), m.encode(msg)])
            return True
        except zmq.ZMQError:
            return False

    async def _receive(self) -> None:
        while True:
            identity, *frames = await self.sock.recv_multipart(copy=False)
            sender = identity.bytes.decode(errors="replace")
            key_role = security.key_role(frames)
            try:
                if len(frames) != 1:
                    raise m.MessageError(f"expected 1 frame after the identity, got {len(frames)}")
                msg = m.decode(frames[0].bytes)
            except m.MessageError as exc:
                log.warning("malformed report from %r: %s", sender, exc)
                continue
            reports = msg.reports if isinstance(msg, m.StepTokens) else [msg]
            for report in reports:
                if not isinstance(report, REPORTS):
                    log.warning("unexpected %s from %r on the report socket", report.TAG, sender)
                    continue
                try:
                    answer = self.route(report, sender, key_role)
                except Exception:  # noqa: BLE001  one report must not end the loop
                    log.exception("handling a report from %r failed", sender)
                    continue
                if answer is not None and not await self.send(sender, answer):
                    log.debug("cannot answer %r: it is not connected", sender)

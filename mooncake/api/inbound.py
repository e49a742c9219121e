"""What reaches an API process from the cluster: the instances' reports of its requests (`_route`, called
by its ReportInbox) and the conductor's answers (`_on_conductor`). A part of `FrontDoor` (front_door.py),
kept apart to keep each file to one concern; it uses the front door's streams and pending placements."""

import logging

from mooncake import messages as m
from mooncake import security
from mooncake.errors import LegFailed, RequestError

log = logging.getLogger(__name__)


class Inbound:
    def _route(self, msg, sender: str, key_role: str | None = None):
        """A report from instance `sender` (over a connection holding a `key_role` key): into its flight's
        inbox if it holds the current leg in that role; a report of a leg that is over is answered with
        `Cancel` so the instance frees it."""
        flight = self.streams.get(msg.request_id)
        if flight is None:
            if isinstance(msg, m.RequestFailed) or msg.finish_reason is not None:
                return None
            return m.Cancel(request_id=msg.request_id)
        p = flight.placement
        if p is not None:
            expected = {m.PrefillDone: p.prefill_ids[-1] if p.prefill_ids else p.decode_id,
                        m.Tokens: p.decode_id}.get(type(msg))
            role = "prefill" if sender in p.prefill_ids else "decode"  # NOTE: colocated instances are decode's
            if (sender not in (*p.prefill_ids, p.decode_id) or expected not in (None, sender)
                    or (security.is_secured() and key_role != role)):
                log.warning("ignored %s of request %s from %r (over a %s key), which does not hold it as a %s",
                            msg.TAG, msg.request_id, sender, key_role, role)
                return None
        if isinstance(msg, m.RequestFailed):
            if msg.is_invalid:
                flight.inbox.put_nowait(RequestError(msg.error, is_invalid=True))
            else:
                flight.inbox.put_nowait(LegFailed(f"instance {sender}: {msg.error}", (sender,)))
            return None
        flight.inbox.put_nowait(msg)
        return None

    async def _on_conductor(self, msg) -> None:
        if isinstance(msg, m.Placed):
            if (answer := self.pending.get(msg.request_id)) is not None and not answer.done():
                answer.set_result(msg)
            elif not msg.refusal and msg.request_id not in self.streams:  # NOTE: placed after we gave up on it
                await self.link.send(m.LegEnded(request_id=msg.request_id))
        elif isinstance(msg, m.LegLost):
            if (flight := self.streams.get(msg.request_id)) is not None:
                flight.inbox.put_nowait(LegFailed(msg.error, tuple(msg.suspects)))
        elif isinstance(msg, m.ClusterReply):
            if self._cluster_wait is not None and not self._cluster_wait.done():
                self._cluster_wait.set_result(msg)
        else:
            log.warning("%s: unexpected %s from the conductor", self.name, msg.TAG)

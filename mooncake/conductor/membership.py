"""What the control plane hands the conductor about its members (control.py calls these on the
conductor): an instance or API process that (re)joined, a decode instance's progress, one that died, and a
report that names no API process. A part of `Conductor` (service.py), kept apart to keep each file to one
concern; it uses the conductor's flights, legs and grace."""

import logging

from mooncake import messages as m
from mooncake.conductor.control import LEFT
from mooncake.conductor.flight import Flight
from mooncake.conductor.instances import Instance
from mooncake.conductor.view import Placement
from mooncake.sampling import SamplingParams

log = logging.getLogger(__name__)


class Membership:
    def _route(self, msg, sender: str):
        """A report of a request from instance `sender` that names no API process (none since the front
        door; an older instance's): the leg it belongs to is not the conductor's to stream, so it is freed."""
        if isinstance(msg, m.RequestFailed) or getattr(msg, "finish_reason", None) is not None:
            return None
        return m.Cancel(request_id=msg.request_id)

    def _on_join(self, instance: Instance, msg: m.Register) -> None:
        """An instance or API process (re)joined: the legs it is named in count on it again. An API process
        that a new conductor does not know yet names the legs it holds in decode: the load view counts them."""
        for flight in self.flights.values():
            if instance.instance_id in flight.holders or instance.instance_id == flight.owner:
                instance.request_ids.add(flight.request_id)
        if instance.role != "api":
            return
        now = self.clock()
        self.grace.back(instance.instance_id, {held.request_id for held in msg.legs})
        for held in msg.legs:
            if held.request_id in self.flights:
                continue
            if self.ended.get(held.request_id) == instance.instance_id:
                # NOTE: freed while it was away, past the grace: what the instances held is gone; it moves it
                self._send_soon(instance.instance_id, m.LegLost(
                    request_id=held.request_id, suspects=[],
                    error=f"API process {instance.instance_id} was silent for longer than "
                          f"conductor.heartbeat_timeout_s + conductor.api_grace_s: the conductor freed the leg"))
                continue
            params = SamplingParams(max_tokens=max(1, held.num_tokens_left))
            flight = Flight(held.request_id, [0] * held.num_tokens, params, instance.instance_id,
                            block_hashes=list(held.block_hashes))
            prefill_id = held.prefill_ids[-1] if held.prefill_ids else ""
            stage_ids = tuple(held.prefill_ids) if len(held.prefill_ids) > 1 else ()
            self._new_leg(flight, Placement(prefill_id, held.decode_id, 0, None, 0.0, 0.0, stage_ids=stage_ids), now)
            flight.in_prefill = bool(held.prefill_ids)
            flight.decode_start_s = now
            flight.is_decode_sent = not held.prefill_ids
            for instance_id in (*held.prefill_ids, held.decode_id):
                self._hold(flight, instance_id)
        if msg.legs:
            log.info("API process %s holds %d legs; counted", instance.instance_id, len(msg.legs))

    def _on_progress(self, instance: Instance, progress: list[m.LegProgress]) -> None:
        """A decode instance's heartbeat: how many tokens each of its legs has produced."""
        for leg in progress:
            if (flight := self.flights.get(leg.request_id)) is not None and instance.instance_id in flight.holders:
                flight.num_decoded = leg.num_tokens

    def _on_dead(self, instance: Instance, why: str) -> None:
        """An instance died: every leg on it is lost, and its API process moves the request. An API process
        died: its legs are freed wherever they are held (nobody streams them), after conductor.api_grace_s
        unless it left cleanly."""
        if instance.role == "api" and why != LEFT and self.grace.keep(instance.instance_id, set(instance.request_ids)):
            return
        for wire_id in list(instance.request_ids):
            flight = self.flights.get(wire_id)
            if flight is None:
                continue
            if instance.role == "api" or flight.owner == instance.instance_id:
                self._end_leg(flight)
                continue
            self._let_go(flight, instance.instance_id, cancel=False)
            self._send_soon(flight.owner, m.LegLost(request_id=wire_id, error=f"{instance.role} instance "
                                                    f"{instance.instance_id} {why}",
                                                    suspects=[instance.instance_id]))

"""How a request's legs and the request itself end in an API process: `_end_leg` (the conductor frees
the leg wherever it is still held) and `_end` (the one terminal state, with the record the conductor
learns from). A part of `FrontDoor` (front_door.py), kept apart to keep each file to one concern."""

import bisect

import msgspec

from mooncake import messages as m
from mooncake.api.flight import Flight
from mooncake.messages import GAP_BUCKETS_S


class Endings:
    def _end_leg(self, flight: Flight, failure: str = "", record: m.LegEnded | None = None) -> None:
        """Forget the current leg; the conductor frees it wherever it is still held."""
        if self.streams.pop(flight.wire_id, None) is None:
            return
        if flight.legs and flight.legs[-1].ended_s is None:
            flight.legs[-1].ended_s, flight.legs[-1].failure = self.clock(), failure
        while not flight.inbox.empty():  # reports of the old leg
            flight.inbox.get_nowait()
        msg = record or m.LegEnded(request_id=flight.wire_id, is_finished=flight.is_finished, failure=failure)
        p = flight.placement
        if p is not None and not flight.is_finished:  # NOTE: so that a conductor that does not know it frees it
            unclaimed = flight.in_prefill or (flight.handed_off is not None)  # no token from decode yet
            holders = [*(p.prefill_ids if flight.in_prefill else ()), *((p.decode_id,) if p.decode_id else ())]
            msg = msgspec.structs.replace(msg, holders=holders, block_hashes=flight.block_hashes if unclaimed else [])
        self._send_soon(msg)

    def _end(self, flight: Flight, outcome: str, counted: bool = True) -> None:
        """The request's one terminal state: forget it, free it wherever it is held, and give the conductor
        its record (`counted`: it was accepted, so it counts as a request)."""
        if flight.ended:
            return
        flight.ended = True
        self.metrics.requests.labels(self.api_id, outcome).inc()
        now = self.clock()
        record = None
        if counted:
            gaps = flight.gaps_s
            slowest = sorted(gaps, reverse=True)[:max(1, len(gaps) // 10)]
            record = m.LegEnded(
                request_id=flight.wire_id, is_finished=flight.is_finished, outcome=outcome,
                migration=flight.migration, num_prompt_tokens=len(flight.prompt_token_ids),
                num_completion_tokens=len(flight.generated), num_legs=flight.num_legs, ttft_s=flight.ttft_s,
                e2e_s=now - flight.admitted_s, predicted_ttft_s=flight.predicted_ttft_s,
                predicted_tbt_s=flight.predicted_tbt_s, mean_gap_s=sum(gaps) / len(gaps) if gaps else 0.0,
                slow_gap_s=sum(slowest) / len(slowest) if slowest else 0.0, gap_counts=_bucketed(gaps),
                gap_sum_s=sum(gaps))
            self.timelines.record(flight, outcome, now)
        if flight.wire_id in self.streams:
            self._end_leg(flight, record=record)
        elif record is not None:
            self._send_soon(record)


def _bucketed(gaps: list[float]) -> list[int]:
    """The gaps counted per latency bucket (each in the first whose bound it does not pass), +Inf last."""
    counts = [0] * (len(GAP_BUCKETS_S) + 1)
    for gap in gaps:
        counts[bisect.bisect_left(GAP_BUCKETS_S, gap)] += 1
    return counts

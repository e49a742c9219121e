"""The cluster view the policies decide on: a prefill instance's queue is what is left of its work."""

import pytest

from mooncake import messages as m
from mooncake.conductor.decide import cluster_view
from mooncake.conductor.flight import Flight, Leg
from mooncake.conductor.instances import InstanceRegistry
from mooncake.sampling import SamplingParams


def flight_on(registry, wire_id: str, placed_s: float, predicted_s: float) -> Flight:
    flight = Flight(wire_id, [1, 2, 3], SamplingParams(), admitted_s=placed_s, deadline_s=1e9, wire_id=wire_id,
                    predicted_prefill_s=predicted_s)
    flight.legs.append(Leg(wire_id, "prefill-0", "decode-0", 0, placed_s))
    registry.get("prefill-0").request_ids.add(wire_id)
    return flight


def queue_at(registry, flights, now: float) -> float:
    view = cluster_view(registry, flights, 16, 1024, frozenset(), now)
    return view.prefills[0].queued_prefill_s


def test_the_queue_credits_the_time_already_spent_on_it():
    registry = InstanceRegistry(heartbeat_timeout_s=1e9)
    registry.register(m.Register(instance_id="prefill-0", role="prefill", model_id="x", block_size=16,
                                 kv_dtype="float32"), now=0.0)
    flights = {f.wire_id: f for f in (flight_on(registry, "a", 10.0, 30.0), flight_on(registry, "b", 12.0, 5.0))}
    assert queue_at(registry, flights, 10.0) == pytest.approx(35.0)
    assert queue_at(registry, flights, 20.0) == pytest.approx(25.0)  # 10 s of it done
    registry.get("prefill-0").last_done_s = 18.0  # it handed another request off at 18 s: working on these since
    assert queue_at(registry, flights, 20.0) == pytest.approx(33.0)
    assert queue_at(registry, flights, 100.0) == 0.0  # overdue: nothing predicted is left

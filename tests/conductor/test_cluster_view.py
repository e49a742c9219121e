"""The cluster view the policies decide on: a prefill instance's queue is what is left of its work."""

import pytest

from mooncake import messages as m
from mooncake.conductor.decide import cluster_view
from mooncake.conductor.flight import Flight
from mooncake.conductor.instances import InstanceRegistry
from mooncake.sampling import SamplingParams


def flight_on(registry, wire_id: str, placed_s: float, predicted_s: float) -> Flight:
    flight = Flight(wire_id, [1, 2, 3], SamplingParams(), owner="api-0", predicted_prefill_s=predicted_s,
                    placed_s=placed_s)
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


def test_decode_load_is_current_context_at_the_instances_last_step_time():
    """A decoding request counts with the context it has now, until its tokens left run out at the step
    time the instance last reported; one still in prefill counts from its predicted hand-off, or from now
    once that is past."""
    registry = InstanceRegistry(heartbeat_timeout_s=1e9)
    registry.register(m.Register(instance_id="decode-0", role="decode", model_id="x", block_size=16,
                                 kv_dtype="float32"), now=0.0)
    decoding = Flight("a", list(range(100)), SamplingParams(max_tokens=50), owner="api-0", in_prefill=False,
                      num_decoded=10)
    waiting = Flight("b", list(range(300)), SamplingParams(max_tokens=20), owner="api-0", decode_start_s=12.0)
    flights = {"a": decoding, "b": waiting}
    registry.get("decode-0").request_ids.update(flights)

    def batch_at(t, now=10.0):
        view = cluster_view(registry, flights, 16, 1024, frozenset(), now, idle_step_s=0.5)
        return view.decodes[0].batch_at(t)

    # no step reported yet: the idle step time, 0.5 s; 40 tokens left from now, 20 from the hand-off
    assert batch_at(11.0) == (1, 110) and batch_at(12.0) == (2, 410) and batch_at(21.9) == (2, 410)
    assert batch_at(22.1) == (1, 110) and batch_at(29.9) == (1, 110) and batch_at(30.1) == (0, 0)
    registry.heartbeat(m.Heartbeat(instance_id="decode-0", step_samples=[m.StepSample(1, 110, 0.1), m.StepSample(1, 111, 0.3)]), now=10.0)
    assert batch_at(15.9) == (2, 410) and batch_at(16.1) == (1, 110) and batch_at(18.1) == (0, 0)  # at 0.2 s
    assert batch_at(16.9, now=13.0) == (2, 410) and batch_at(17.1, now=13.0) == (1, 110)  # a late hand-off
    decoding.num_decoded += 20  # at 20 s, 20 tokens later (decode's heartbeat says): 20 left, longer context
    assert batch_at(23.9, now=20.0) == (2, 430) and batch_at(24.1, now=20.0) == (0, 0)


def test_decode_load_counts_the_tokens_the_learned_lengths_predict_not_the_cap():
    """A client's max_tokens is a cap: the view counts what the answers seen so far say is left."""
    from mooncake.conductor.estimators import OutputLengthModel

    registry = InstanceRegistry(heartbeat_timeout_s=1e9)
    registry.register(m.Register(instance_id="decode-0", role="decode", model_id="x", block_size=16,
                                 kv_dtype="float32"), now=0.0)
    flights = {"a": Flight("a", list(range(100)), SamplingParams(max_tokens=2000), owner="api-0", in_prefill=False,
                           num_decoded=10)}
    registry.get("decode-0").request_ids.update(flights)
    lengths = OutputLengthModel(min_samples=4)
    for n in (30, 50, 70, 90):
        lengths.observe(n)
    view = cluster_view(registry, flights, 16, 1024, frozenset(), 0.0, idle_step_s=1.0, output_lengths=lengths)
    assert view.decodes[0].requests[0].finish_s == pytest.approx(60 - 10)  # E[L | L > 10] = 60, 10 written
    view = cluster_view(registry, flights, 16, 1024, frozenset(), 0.0, idle_step_s=1.0)
    assert view.decodes[0].requests[0].finish_s == pytest.approx(1990)  # without: the cap less what it wrote

"""A request's timeline as OpenTelemetry spans (the SDK's in-memory exporter) and as its log line: a
request that moved once, with the prefill split it reported and one event per token gap."""

import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mooncake.api.flight import Flight, Leg
from mooncake.api.timeline import Timelines
from mooncake.errors import ConfigError
from mooncake.sampling import SamplingParams


def moved_request() -> Flight:
    """Admitted at 100 s; leg 1 decodes 2 tokens and its decode dies; leg 2 finishes after 3 more."""
    f = Flight("r1", [1, 2, 3, 4], SamplingParams(max_tokens=6), admitted_s=100.0, deadline_s=1000.0)
    first = Leg("r1", "prefill-0", "decode-0", 0, placed_s=100.0, prefill_done_s=100.5, queue_s=0.1, fetch_s=0.05,
                compute_s=0.3, kv_transfer_s=0.02, first_decode_token_s=100.6, ended_s=102.0,
                failure="decode instance decode-0 stopped responding")
    second = Leg("r1.1", "prefill-1", "decode-1", 1, placed_s=102.0, prefill_done_s=102.2, queue_s=0.0,
                 compute_s=0.15, first_decode_token_s=102.3)
    f.legs, f.num_legs = [first, second], 2
    f.token_times_s = [100.5, 100.6, 100.7, 102.2, 102.3, 102.4]  # leg 1: 3 tokens; leg 2: 3 tokens
    f.gaps_s = [b - a for a, b in zip(f.token_times_s, f.token_times_s[1:])]
    f.generated, f.ttft_s, f.num_cached_tokens = [9] * 6, 0.5, 0
    return f


def test_a_moved_request_becomes_nested_spans_with_its_prefill_split_and_token_gaps():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    clock = iter([200.0] * 10)
    Timelines(provider=provider, clock=lambda: next(clock)).record(moved_request(), "ok", end_s=102.5)
    spans = {(s.name, s.attributes.get("wire_id", "")): s for s in exporter.get_finished_spans()}
    names = sorted(s.name for s in exporter.get_finished_spans())
    assert names == sorted(["request", "leg", "leg", "prefill", "prefill", "decode admission", "decode admission",
                            "decode", "decode"])
    root = spans[("request", "")]
    assert root.parent is None and root.attributes["outcome"] == "ok" and root.attributes["legs"] == 2
    assert (root.end_time - root.start_time) / 1e9 == pytest.approx(2.5)
    first, second = spans[("leg", "r1")], spans[("leg", "r1.1")]
    assert first.parent.span_id == root.context.span_id and second.parent.span_id == root.context.span_id
    assert "stopped responding" in first.attributes["failure"] and second.attributes["failure"] == ""
    assert first.attributes["decode_id"] == "decode-0" and second.attributes["decode_id"] == "decode-1"
    by_parent = {}
    for s in exporter.get_finished_spans():
        if s.parent is not None:
            by_parent.setdefault(s.parent.span_id, []).append(s)
    prefill = next(s for s in by_parent[first.context.span_id] if s.name == "prefill")
    assert prefill.attributes["queue_s"] == 0.1 and prefill.attributes["pool_fetch_s"] == 0.05
    assert (prefill.end_time - prefill.start_time) / 1e9 == pytest.approx(0.5)
    decodes = [next(s for s in by_parent[leg.context.span_id] if s.name == "decode") for leg in (first, second)]
    assert [len(d.events) for d in decodes] == [1, 1]  # the gaps after each leg's first decode token
    assert decodes[1].events[0].attributes["gap_s"] == pytest.approx(0.1)
    # The wall-clock times keep the conductor's spacing: leg 2 starts 2 s after the request.
    assert (second.start_time - root.start_time) / 1e9 == pytest.approx(2.0)


def test_without_an_endpoint_a_request_is_one_log_line(caplog):
    caplog.set_level(logging.INFO, logger="mooncake.api.timeline")
    Timelines().record(moved_request(), "ok", end_s=102.5)
    (line,) = [r.getMessage() for r in caplog.records]
    for part in ("request r1 outcome=ok", "completion_tokens=6", "legs=2", "queue_s=0.100", "fetch_s=0.050",
                 "compute_s=0.300", "decode_admission_s=0.100", "prefill=prefill-1 decode=decode-1"):
        assert part in line


def test_an_endpoint_without_the_exporter_installed_is_a_config_error_naming_the_key():
    try:
        import opentelemetry.exporter.otlp.proto.http  # noqa: F401
        pytest.skip("the OTLP exporter is installed here")
    except ImportError:
        pass
    with pytest.raises(ConfigError, match="conductor.otlp_endpoint"):
        Timelines("http://127.0.0.1:4318/v1/traces")

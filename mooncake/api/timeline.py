"""Where each request's time went, told once it ended: one key=value log line always, and OpenTelemetry
spans when `conductor.otlp_endpoint` is set (or a tracer provider is given, as tests do).

The spans, built from the times the API process recorded (flight.py's Leg), nested:

  request                      admission to the end; outcome, token counts, TTFT, TBT mean and max
    leg                        one placement (a migrated request has several); instances, failure
      prefill                  placement to PrefillDone; queue, pool fetch, compute, KV transfer seconds
      decode admission         PrefillDone to the first token from decode
      decode                   the first token from decode to the leg's end; an event per token gap"""

import logging
import statistics
import time

from mooncake.api.flight import Flight
from mooncake.errors import ConfigError

log = logging.getLogger(__name__)


class Timelines:
    def __init__(self, otlp_endpoint: str = "", provider=None, clock=time.monotonic):
        self.clock = clock
        self._owns_provider = provider is None and bool(otlp_endpoint)
        self.provider = _otlp_provider(otlp_endpoint) if self._owns_provider else provider
        self.tracer = self.provider.get_tracer("mooncake.api") if self.provider is not None else None

    def record(self, flight: Flight, outcome: str, end_s: float) -> None:
        gaps = flight.gaps_s
        first = flight.legs[0] if flight.legs else None
        tbt_mean, tbt_max = (statistics.fmean(gaps), max(gaps)) if gaps else (0.0, 0.0)
        admission_s = (first.first_decode_token_s - first.prefill_done_s
                       if first and first.first_decode_token_s and first.prefill_done_s else 0.0)
        # NOTE: one line per request, key=value, for log search (the request id is the one instances log).
        log.info("request %s outcome=%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d ttft_s=%.3f "
                 "predicted_ttft_s=%.3f predicted_tbt_s=%.4f e2e_s=%.3f legs=%d queue_s=%.3f fetch_s=%.3f compute_s=%.3f kv_transfer_s=%.3f "
                 "decode_admission_s=%.3f tbt_mean_s=%.4f tbt_max_s=%.4f prefill=%s decode=%s",
                 flight.request_id, outcome, len(flight.prompt_token_ids), flight.num_cached_tokens,
                 len(flight.generated), flight.ttft_s, flight.predicted_ttft_s, flight.predicted_tbt_s,
                 end_s - flight.admitted_s, flight.num_legs,
                 first.queue_s if first else 0.0, first.fetch_s if first else 0.0, first.compute_s if first else 0.0,
                 first.kv_transfer_s if first else 0.0, admission_s, tbt_mean, tbt_max,
                 flight.legs[-1].prefill_id if first else "-", flight.legs[-1].decode_id if first else "-")
        if self.tracer is not None:
            try:
                self._spans(flight, outcome, end_s, tbt_mean, tbt_max)
            except Exception:  # noqa: BLE001  tracing must never cost a request
                log.exception("could not record the spans of request %s", flight.request_id)

    def _spans(self, flight: Flight, outcome: str, end_s: float, tbt_mean: float, tbt_max: float) -> None:
        from opentelemetry import trace
        offset_ns = time.time_ns() - int(self.clock() * 1e9)  # the conductor's clock to wall-clock ns

        def ns(t: float) -> int:
            return int(t * 1e9) + offset_ns

        def span(name, start_s, parent, **attributes):
            return self.tracer.start_span(name, context=trace.set_span_in_context(parent) if parent else None,
                                          start_time=ns(start_s), attributes=attributes)

        root = span("request", flight.admitted_s, None, request_id=flight.request_id, outcome=outcome,
                    prompt_tokens=len(flight.prompt_token_ids), cached_tokens=flight.num_cached_tokens,
                    completion_tokens=len(flight.generated), ttft_s=flight.ttft_s, tbt_mean_s=tbt_mean,
                    tbt_max_s=tbt_max, legs=flight.num_legs)
        times = flight.token_times_s
        for leg in flight.legs:
            leg_end = leg.ended_s if leg.ended_s is not None else end_s
            node = span("leg", leg.placed_s, root, wire_id=leg.wire_id, prefill_id=leg.prefill_id,
                        decode_id=leg.decode_id, reuse_blocks=leg.reuse_blocks, failure=leg.failure)
            done = leg.prefill_done_s if leg.prefill_done_s is not None else leg_end
            child = span("prefill", leg.placed_s, node, queue_s=leg.queue_s, pool_fetch_s=leg.fetch_s,
                         compute_s=leg.compute_s, kv_transfer_s=leg.kv_transfer_s)
            child.end(end_time=ns(done))
            if leg.prefill_done_s is not None and leg.first_decode_token_s is not None:
                child = span("decode admission", leg.prefill_done_s, node)
                child.end(end_time=ns(leg.first_decode_token_s))
                decode = span("decode", leg.first_decode_token_s, node)
                for before, t in zip(times, times[1:]):
                    if leg.first_decode_token_s < t <= leg_end:  # the first one closes decode admission
                        decode.add_event("token", {"gap_s": t - before}, timestamp=ns(t))
                decode.end(end_time=ns(leg_end))
            node.end(end_time=ns(leg_end))
        root.end(end_time=ns(end_s))

    def shutdown(self) -> None:
        """Flush and close the exporter this object made (a provider handed in is its owner's)."""
        if self._owns_provider:
            self.provider.shutdown()


def _otlp_provider(endpoint: str):
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise ConfigError(f"conductor.otlp_endpoint = {endpoint} needs the OpenTelemetry SDK and its OTLP "
                          "exporter: pip install '.[otel]'") from None
    provider = TracerProvider(resource=Resource.create({"service.name": "mooncake-conductor"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    log.info("request timelines go to %s as OpenTelemetry spans", endpoint)
    return provider

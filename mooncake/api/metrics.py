"""An API process's own Prometheus series, appended to the conductor's at GET /metrics: each labelled with
the process's id, so a scrape behind a shared port or a load balancer tells the processes apart (scrape
each one directly to see all of them)."""

import resource

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class ApiMetrics:
    def __init__(self, api_id: str, streams_running):
        self.api_id = api_id
        r = self.registry = CollectorRegistry()
        self.tokens = Counter("mooncake_api_streamed_tokens", "Tokens this API process streamed to its clients",
                              ["api"], registry=r).labels(api_id)
        self.requests = Counter("mooncake_api_requests", "Requests this API process ended, by outcome",
                                ["api", "outcome"], registry=r)
        r.register(_Process(api_id, streams_running))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Process:
    """Its CPU time and running streams, read at scrape time."""

    def __init__(self, api_id: str, streams_running):
        self.labels = [api_id]
        self.streams_running = streams_running

    def collect(self):
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = CounterMetricFamily("mooncake_api_cpu_seconds", "CPU seconds this API process used (all its threads)",
                                  labels=["api"])
        cpu.add_metric(self.labels, usage.ru_utime + usage.ru_stime)
        streams = GaugeMetricFamily("mooncake_api_streams", "Requests this API process is streaming", labels=["api"])
        streams.add_metric(self.labels, self.streams_running())
        return [cpu, streams]

"""The conductor's Prometheus metrics (served at GET /metrics): request latencies, prefix hits, KV
transfers, rejections and per-instance load. One registry per conductor, so tests can run several.

Beside ours, the same measurements under vLLM's names (`vllm:*`, with a `model_name` label), so the
dashboards and alerts of a vLLM deployment read a mooncake cluster as they are (`_VllmSeries`)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from mooncake.messages import GAP_BUCKETS_S

disable_created_metrics()  # the *_created series only add noise to a scrape

LATENCY_BUCKETS_S = GAP_BUCKETS_S
STEP_RATIO_BUCKETS = (1.0, 1.01, 1.02, 1.05, 1.1, 1.25, 1.5, 2, 4, 8)
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.15, 1.25, 1.5, 2, 4)


class ConductorMetrics:
    def __init__(self, model_name: str = ""):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("mooncake_requests", "Finished requests by outcome (ok, error, cancelled)",
                                ["outcome"], registry=r)
        self.migrations = Counter("mooncake_migrations", "Requests moved to other instances after a failure, by "
                                  "outcome (moved; limit: past conductor.migration_limit; no_instance)",
                                  ["outcome"], registry=r)
        self.rejections = Counter("mooncake_rejections", "Requests rejected at admission, by reason",
                                  ["reason"], registry=r)
        self.ttft = Histogram("mooncake_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS_S,
                              registry=r)
        self.tbt = Histogram("mooncake_tbt_seconds", "Time between tokens", buckets=LATENCY_BUCKETS_S,
                             registry=r)
        self.e2e = Histogram("mooncake_e2e_request_seconds", "Admission to the last token, of requests that "
                             "finished", buckets=LATENCY_BUCKETS_S + (120, 300), registry=r)
        self.queue = Histogram("mooncake_queue_seconds", "Prefill-side wait: receipt to hand-off less compute "
                               "and pool reads", buckets=LATENCY_BUCKETS_S, registry=r)
        # NOTE: predicted / measured of each request that stayed on its first placement: 1 is a prediction
        # that held; the admission policy is only as good as this.
        self.ttft_prediction = Histogram("mooncake_ttft_prediction_ratio", "Predicted over measured time to "
                                         "first token, per request", buckets=RATIO_BUCKETS, registry=r)
        self.tbt_prediction = Histogram("mooncake_tbt_prediction_ratio", "Predicted decode step time over the "
                                        "measured mean time between tokens, per request", buckets=RATIO_BUCKETS,
                                        registry=r)
        self.emulated_step = Histogram("mooncake_emulated_step_ratio", "An emulated instance's measured over "
                                       "modelled step time (from the previous step's modelled end when they run "
                                       "back to back): above 1, this box falls behind the emulated hardware",
                                       ["role"], buckets=STEP_RATIO_BUCKETS, registry=r)
        self.slo = Counter("mooncake_slo_requests", "Finished requests by whether they met both SLOs (TTFT, and "
                           "TBT as the mean of a request's slowest 10% of gaps): goodput", ["within_slo"],
                           registry=r)
        self.prompt_tokens = Counter("mooncake_prompt_tokens", "Prompt tokens of served requests", registry=r)
        self.cached_tokens = Counter("mooncake_prefix_hit_tokens",
                                     "Prompt tokens reused from a prefix cache instead of computed", registry=r)
        self.computed_tokens = Counter("mooncake_prefill_computed_tokens",
                                       "Prompt tokens prefill instances ran through the model", ["instance"],
                                       registry=r)
        self.completion_tokens = Counter("mooncake_completion_tokens", "Generated tokens", registry=r)
        self.kv_bytes = Counter("mooncake_kv_transfer_bytes", "KV bytes pushed from prefill to decode",
                                ["instance"], registry=r)
        self.kv_seconds = Counter("mooncake_kv_transfer_seconds", "Seconds spent pushing KV to decode",
                                  ["instance"], registry=r)
        self.fetch_bytes = Counter("mooncake_kv_fetch_bytes", "KV bytes prefill read from the cache pool",
                                   ["instance"], registry=r)
        self.in_flight = Gauge("mooncake_requests_in_flight", "Requests placed on an instance, not finished",
                               ["instance"], registry=r)
        self.up = Gauge("mooncake_instance_up", "1 while the instance heartbeats", ["instance", "role"],
                        registry=r)
        self.waiting = Gauge("mooncake_instance_waiting_requests", "Queued in the instance's engine",
                             ["instance"], registry=r)
        self.running = Gauge("mooncake_instance_running_requests", "Running in the instance's engine",
                             ["instance"], registry=r)
        self.kv_used = Gauge("mooncake_instance_kv_blocks_used", "KV blocks held by requests", ["instance"],
                             registry=r)
        self.kv_inbox = Gauge("mooncake_instance_kv_inbox_blocks", "KV blocks pushed to a decode instance that no "
                              "request has claimed yet", ["instance"], registry=r)
        self.kv_total = Gauge("mooncake_instance_kv_blocks", "KV blocks of the instance", ["instance"], registry=r)
        # The cache nodes' own counters, polled by the conductor so one scrape covers the pool too.
        node_tier = ["node", "tier"]
        self.pool = _PoolCounters()
        r.register(self.pool)
        self.cache_blocks = Gauge("mooncake_cache_blocks", "Blocks held, per cache node and tier", node_tier,
                                  registry=r)
        self.cache_used = Gauge("mooncake_cache_used_bytes", "Bytes held, per cache node and tier", node_tier,
                                registry=r)
        self.cache_capacity = Gauge("mooncake_cache_capacity_bytes", "Capacity, per cache node and tier", node_tier,
                                    registry=r)
        self.cache_rate = Gauge("mooncake_cache_transfer_gbytes_per_s",
                                "Mean rate of the puts and gets a cache node served", ["node", "op"], registry=r)
        self.cache_lent = Gauge("mooncake_cache_write_window_bytes",
                                "DRAM a cache node has lent to same-host writers and not yet filled", ["node"],
                                registry=r)
        self.index_blocks = Gauge("mooncake_prefix_index_blocks", "Block hashes in the global prefix index",
                                  registry=r)
        r.register(_VllmSeries(self, model_name))

    def watch_index(self, index) -> None:
        """Export the prefix index's blocks per holder (`mooncake_prefix_index_holder_blocks`)."""
        self.registry.register(_IndexSeries(index))

    def record_cache_stats(self, node: str, stats: dict) -> None:
        """One cache node's `stats` reply (see mooncake/store/server.py) into the gauges and counters."""
        self.pool.nodes[node] = stats
        for gauge, key in ((self.cache_blocks, "blocks"), (self.cache_used, "used_bytes"),
                           (self.cache_capacity, "capacity_bytes")):
            for tier, n in stats.get(key, {}).items():
                gauge.labels(node, tier).set(n)
        for op, served in stats.get("transfers", {}).items():
            self.cache_rate.labels(node, op).set(served.get("gbytes_per_s", 0.0))
        self.cache_lent.labels(node).set(stats.get("write_windows", {}).get("lent_bytes", 0))

    def record_request(self, msg) -> None:
        """A finished request's record (`LegEnded` with an outcome) from the API process that owned it."""
        self.requests.labels(msg.outcome).inc()
        self.prompt_tokens.inc(msg.num_prompt_tokens)
        self.completion_tokens.inc(msg.num_completion_tokens)
        if msg.num_completion_tokens:
            self.ttft.observe(msg.ttft_s)
            if msg.num_legs == 1 and msg.ttft_s > 0 and msg.predicted_ttft_s > 0:
                self.ttft_prediction.observe(msg.predicted_ttft_s / msg.ttft_s)
        # NOTE: the API process counted its gaps in the same buckets: they add up to the histogram of them all
        tbt = self.tbt
        for bucket, n in zip(tbt._buckets, msg.gap_counts[:len(tbt._buckets)]):
            if n > 0:
                bucket.inc(n)
        if msg.gap_sum_s > 0:
            tbt._sum.inc(msg.gap_sum_s)
        if msg.outcome == "ok":
            self.e2e.observe(msg.e2e_s)
            if msg.num_legs == 1 and msg.predicted_tbt_s > 0 and msg.mean_gap_s > 0:
                self.tbt_prediction.observe(msg.predicted_tbt_s / msg.mean_gap_s)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _PoolCounters:
    """The cache nodes' running totals, as counters: they only grow (a restarted node starts again from
    zero, which Prometheus' rate() reads as a counter reset)."""

    def __init__(self):
        self.nodes: dict[str, dict] = {}  # node id -> its latest stats reply

    def collect(self):
        hits = CounterMetricFamily("mooncake_cache_hits", "Reads served, per cache node and tier", labels=["node", "tier"])
        misses = CounterMetricFamily("mooncake_cache_misses", "Reads of absent blocks, per cache node", labels=["node"])
        evictions = CounterMetricFamily("mooncake_cache_evictions", "Blocks evicted, per cache node and tier",
                                        labels=["node", "tier"])
        moved = CounterMetricFamily("mooncake_cache_bytes", "Block bytes in (put) and out (get), per cache node",
                                    labels=["node", "direction"])
        for node, stats in self.nodes.items():
            for tier, n in stats.get("hits", {}).items():
                hits.add_metric([node, tier], n)
            misses.add_metric([node], stats.get("misses", 0))
            for tier, n in stats.get("evictions", {}).items():
                evictions.add_metric([node, tier], n)
            moved.add_metric([node, "in"], stats.get("bytes_in", 0))
            moved.add_metric([node, "out"], stats.get("bytes_out", 0))
        return [hits, misses, evictions, moved]


class _IndexSeries:
    """Blocks per holder (prefill instance or cache node) in the global prefix index, read at scrape time:
    how far the index has heard of what each holder has."""

    def __init__(self, index):
        self.index = index

    def collect(self):
        family = GaugeMetricFamily("mooncake_prefix_index_holder_blocks", "Blocks per holder in the global "
                                   "prefix index", labels=["holder"])
        for holder, count in sorted(self.index.counts().items()):
            family.add_metric([holder], count)
        yield family


class _VllmSeries:
    """Our measurements under vLLM's metric names, computed at scrape time from the series above (one
    measurement, two names). Instance gauges are summed over the live instances."""

    HISTOGRAMS = (("ttft", "vllm:time_to_first_token_seconds", "Time to first token"),
                  ("tbt", "vllm:inter_token_latency_seconds", "Time between tokens"),
                  ("e2e", "vllm:e2e_request_latency_seconds", "End-to-end latency of finished requests"),
                  ("queue", "vllm:request_queue_time_seconds", "Time requests waited before their prefill"))
    COUNTERS = (("prompt_tokens", "vllm:prompt_tokens", "Prompt tokens"),
                ("completion_tokens", "vllm:generation_tokens", "Generated tokens"),
                ("prompt_tokens", "vllm:prefix_cache_queries", "Prompt tokens looked up in a prefix cache"),
                ("cached_tokens", "vllm:prefix_cache_hits", "Prompt tokens found in a prefix cache"))

    def __init__(self, metrics: ConductorMetrics, model_name: str):
        self.m = metrics
        self.model = [model_name]

    def collect(self):
        for attr, name, doc in self.HISTOGRAMS:
            samples = _samples(getattr(self.m, attr))
            family = HistogramMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(self.model, [(s.labels["le"], s.value) for s in samples if s.name.endswith("_bucket")],
                              sum_value=next(s.value for s in samples if s.name.endswith("_sum")))
            yield family
        for attr, name, doc in self.COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(self.model, next(s.value for s in _samples(getattr(self.m, attr))
                                               if s.name.endswith("_total")))
            yield family
        live = {s.labels["instance"] for s in _samples(self.m.up) if s.value == 1}
        for attr, name, doc in (("running", "vllm:num_requests_running", "Requests running in the engines"),
                                ("waiting", "vllm:num_requests_waiting", "Requests queued in the engines")):
            yield self._gauge(name, doc, sum(_by_instance(getattr(self.m, attr), live).values()))
        total = sum(_by_instance(self.m.kv_total, live).values())
        used = sum(_by_instance(self.m.kv_used, live).values())
        yield self._gauge("vllm:kv_cache_usage_perc", "Share of the instances' KV blocks in use (0-1)",
                          used / total if total else 0.0)

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        family.add_metric(self.model, value)
        return family


def _samples(metric) -> list:
    return [s for family in metric.collect() for s in family.samples]


def _by_instance(gauge: Gauge, live: set[str]) -> dict[str, float]:
    return {s.labels["instance"]: s.value for s in _samples(gauge) if s.labels.get("instance") in live}

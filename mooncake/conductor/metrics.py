"""The conductor's Prometheus metrics (served at GET /metrics): request latencies, prefix hits, KV
transfers, rejections and per-instance load. One registry per conductor, so tests can run several."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # the *_created series only add noise to a scrape

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ConductorMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("mooncake_requests", "Finished requests by outcome (ok, error, cancelled)",
                                ["outcome"], registry=r)
        self.rejections = Counter("mooncake_rejections", "Requests rejected at admission, by reason",
                                  ["reason"], registry=r)
        self.ttft = Histogram("mooncake_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS_S,
                              registry=r)
        self.tbt = Histogram("mooncake_tbt_seconds", "Time between tokens", buckets=LATENCY_BUCKETS_S,
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
        self.kv_total = Gauge("mooncake_instance_kv_blocks", "KV blocks of the instance", ["instance"], registry=r)
        # The cache nodes' own counters, polled by the conductor so one scrape covers the pool too.
        node_tier = ["node", "tier"]
        self.cache_hits = Gauge("mooncake_cache_hits", "Reads served, per cache node and tier", node_tier, registry=r)
        self.cache_misses = Gauge("mooncake_cache_misses", "Reads of absent blocks, per cache node", ["node"],
                                  registry=r)
        self.cache_evictions = Gauge("mooncake_cache_evictions", "Blocks evicted, per cache node and tier",
                                     node_tier, registry=r)
        self.cache_blocks = Gauge("mooncake_cache_blocks", "Blocks held, per cache node and tier", node_tier,
                                  registry=r)
        self.cache_used = Gauge("mooncake_cache_used_bytes", "Bytes held, per cache node and tier", node_tier,
                                registry=r)
        self.cache_capacity = Gauge("mooncake_cache_capacity_bytes", "Capacity, per cache node and tier", node_tier,
                                    registry=r)
        self.cache_bytes = Gauge("mooncake_cache_bytes", "Block bytes in (put) and out (get), per cache node",
                                 ["node", "direction"], registry=r)
        self.cache_rate = Gauge("mooncake_cache_transfer_gbytes_per_s",
                                "Mean rate of the puts and gets a cache node served", ["node", "op"], registry=r)
        self.cache_lent = Gauge("mooncake_cache_write_window_bytes",
                                "DRAM a cache node has lent to same-host writers and not yet filled", ["node"],
                                registry=r)
        self.index_blocks = Gauge("mooncake_prefix_index_blocks", "Block hashes in the global prefix index",
                                  registry=r)

    def record_cache_stats(self, node: str, stats: dict) -> None:
        """One cache node's `stats` reply (see mooncake/store/server.py) into the gauges."""
        for tier, n in stats.get("hits", {}).items():
            self.cache_hits.labels(node, tier).set(n)
        self.cache_misses.labels(node).set(stats.get("misses", 0))
        for tier, n in stats.get("evictions", {}).items():
            self.cache_evictions.labels(node, tier).set(n)
        for gauge, key in ((self.cache_blocks, "blocks"), (self.cache_used, "used_bytes"),
                           (self.cache_capacity, "capacity_bytes")):
            for tier, n in stats.get(key, {}).items():
                gauge.labels(node, tier).set(n)
        self.cache_bytes.labels(node, "in").set(stats.get("bytes_in", 0))
        self.cache_bytes.labels(node, "out").set(stats.get("bytes_out", 0))
        for op, served in stats.get("transfers", {}).items():
            self.cache_rate.labels(node, op).set(served.get("gbytes_per_s", 0.0))
        self.cache_lent.labels(node).set(stats.get("write_windows", {}).get("lent_bytes", 0))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

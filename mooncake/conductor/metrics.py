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
        self.index_blocks = Gauge("mooncake_prefix_index_blocks", "Block hashes in the global prefix index",
                                  registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

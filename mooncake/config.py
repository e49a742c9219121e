"""Configuration as data: frozen dataclasses loaded from TOML; an unknown or mistyped key is a
`ConfigError` that names it (e.g. `engine.blok_size`)."""

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mooncake import env
from mooncake.addresses import port_range
from mooncake.config_codec import from_dict, toml_value
from mooncake.cost import STEP_MODELS
from mooncake.errors import ConfigError, check_config as _check
from mooncake.sim.config import SimConfig  # noqa: F401  (the [sim] table; imported from here too)

DTYPES = ("float32", "bfloat16", "float16", "auto")
PREFILL_BATCHING = ("auto", "serial", "budget")


def resolve_dtype(dtype: str, device: str, cpu_flags: set[str] | None = None) -> str:
    """`engine.dtype` as the engine runs it. "auto": bfloat16 on CUDA, and on a CPU with bfloat16 matrix
    instructions (AMX or AVX512-BF16), where it runs about twice as fast as float32 in half the memory;
    float32 elsewhere. Every instance and the conductor must resolve to the same dtype (the conductor
    refuses an instance that does not), so across hosts of different CPUs set it explicitly."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16"
    flags = env.cpu_flags() if cpu_flags is None else cpu_flags
    return "bfloat16" if flags & {"amx_bf16", "avx512_bf16"} else "float32"


@dataclass(frozen=True)
class EngineConfig:
    """The model runner and its paged KV cache (one per prefill or decode instance)."""

    model: str = "smollm2-135m-instruct"  # catalog name or a local Hugging Face directory
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", ...
    dtype: str = "float32"  # or "auto" (resolve_dtype): what `mooncake dev` runs without a config
    block_size: int = 64  # tokens per KV block, system-wide
    kv_cache_bytes: int = 1 << 30  # size of the paged KV pool; ignored when num_kv_blocks > 0
    num_kv_blocks: int = 0
    prefill_chunk: int = 512  # tokens of one sequence's prefill computed per step
    max_num_batched_tokens: int = 2048  # per-step token budget (decode tokens + prefill chunks)
    max_num_seqs: int = 64  # sequences running at once
    # "budget": a step fills its token budget with chunks of several prompts (vLLM-style; a prompt's last
    # chunk is topped up with the next one's tokens); "serial": a step computes at most one prompt's chunk,
    # first come first served, so no prompt's first token waits for a later prompt's tokens (the paper's
    # prefill instances, and the queue the conductor predicts); "auto": serial on a prefill instance,
    # budget elsewhere. Decode tokens batch either way.
    prefill_batching: str = "auto"
    enable_prefix_cache: bool = True
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    num_threads: int = 0  # torch intra-op threads; 0 keeps torch's default
    emulation_speedup: float = 1.0  # emulated models only: every modelled step time is divided by this
    # Emulated models only: how a step mixing prefill and decode is charged (mooncake/cost.py STEP_MODELS,
    # "roofline" or "additive"); "": the model's own [cost] step_model.
    emulation_step_model: str = ""

    @property
    def kv_dtype(self) -> str:
        """The dtype the engine runs and its KV blocks carry: `dtype` with "auto" resolved on this host."""
        return resolve_dtype(self.dtype, self.device)

    def __post_init__(self):
        _check(self.dtype in DTYPES, "engine.dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _check(self.device == "cpu" or self.device.startswith("cuda"), "engine.device",
               f"must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        for key in ("block_size", "prefill_chunk", "max_num_batched_tokens", "max_num_seqs", "kv_cache_bytes"):
            _check(getattr(self, key) > 0, f"engine.{key}", "must be > 0")
        _check(self.emulation_speedup > 0, "engine.emulation_speedup", "must be > 0")
        _check(self.emulation_step_model in ("",) + STEP_MODELS, "engine.emulation_step_model",
               f"must be one of {', '.join(STEP_MODELS)} (or empty: the model's own)")
        _check(self.prefill_batching in PREFILL_BATCHING, "engine.prefill_batching",
               f"must be one of {', '.join(PREFILL_BATCHING)}, got {self.prefill_batching!r}")
        for key in ("num_kv_blocks", "max_model_len", "num_threads"):
            _check(getattr(self, key) >= 0, f"engine.{key}", "must be >= 0")
        _check(self.max_num_batched_tokens >= self.max_num_seqs, "engine.max_num_batched_tokens",
               "must be >= engine.max_num_seqs so every running sequence can decode each step")


@dataclass(frozen=True)
class StoreConfig:
    """The KVCache store of a cache node: a DRAM tier and an optional SSD tier."""

    dram_bytes: int = 1 << 30  # preallocated arena
    ssd_dir: str = ""  # empty: no SSD tier
    ssd_bytes: int = 0
    ssd_fsync: bool = True  # fsync each block file and the directory (crash safety)
    eviction: str = "lru"  # "lru", "lfu" or "length-aware"
    lease_s: float = 10.0  # how long a read keeps its block from eviction, at most

    def __post_init__(self):
        _check(self.dram_bytes > 0, "store.dram_bytes", "must be > 0")
        _check(self.ssd_bytes >= 0, "store.ssd_bytes", "must be >= 0")
        _check(not self.ssd_dir or self.ssd_bytes > 0, "store.ssd_bytes", "must be > 0 when store.ssd_dir is set")
        _check_known("eviction", self.eviction, "store.eviction")
        _check(self.lease_s > 0, "store.lease_s", "must be > 0")


PROTOCOLS = ("tcp", "rdma")


@dataclass(frozen=True)
class TransportConfig:
    """What every KV transport endpoint of a process is built with (`mooncake/transfer/`), whichever
    transport [instance] or [cache] selects."""

    host: str = ""  # where data endpoints listen, and the address peers are told; empty: this host's
    # address on the route to instance.conductor_address (127.0.0.1 when the conductor is on loopback)
    protocol: str = "tcp"  # the mooncake transport: "tcp", or "rdma" on hosts with RDMA NICs
    rdma_devices: tuple[str, ...] = ()  # rdma: the NICs to use, e.g. ["mlx5_0"]; empty: every one found
    metadata_server: str = "P2PHANDSHAKE"  # the mooncake transport's Transfer Engine metadata; P2PHANDSHAKE: none
    shm_segment_bytes: int = 256 << 20  # the shm transport: each endpoint's shared-memory segment
    te_ports: str = ""  # "LOW-HIGH": the Transfer Engine's ports (it binds every interface); empty: 15000-17000

    def __post_init__(self):
        _check(self.protocol in PROTOCOLS, "transport.protocol", f"must be one of {', '.join(PROTOCOLS)}")
        _check(not self.te_ports or port_range(self.te_ports), "transport.te_ports",
               f"must be \"LOW-HIGH\" with 1024 <= LOW < HIGH <= 32767, got {self.te_ports!r}")
        _check(self.host not in ("0.0.0.0", "*", "::"), "transport.host",
               "is what peers are told, so it must be this host's reachable address, not a wildcard")
        _check(self.shm_segment_bytes > 0, "transport.shm_segment_bytes", "must be > 0")


@dataclass(frozen=True)
class CacheConfig:
    """The cache role's endpoints (`mooncake serve --role cache`); its store is the [store] table."""

    node_id: str = "cache-0"
    control_address: str = "tcp://127.0.0.1:7600"  # requests: hello, exists, match_prefix, remove, stats
    events_address: str = "tcp://127.0.0.1:7601"  # published batches of add/evict events
    data_address: str = ""  # where the transport listens; empty: any free loopback port
    transport: str = "tcp"
    event_interval_s: float = 0.05  # how often queued store events are published
    read_lease_s: float = 5.0  # how long a block being sent to a reader stays pinned

    def __post_init__(self):
        _check_known("transports", self.transport, "cache.transport")
        for key in ("event_interval_s", "read_lease_s"):
            _check(getattr(self, key) > 0, f"cache.{key}", "must be > 0")
        for key in ("control_address", "events_address"):
            _check("://" in getattr(self, key), f"cache.{key}", "must be a ZeroMQ address like tcp://127.0.0.1:7600")


@dataclass(frozen=True)
class CacheClientConfig:
    """How prefill and decode reach the cache nodes."""

    nodes: tuple[str, ...] = ("tcp://127.0.0.1:7600",)  # control addresses of the cache nodes; empty: no pool
    replica_num: int = 1  # copies of each block, on different nodes
    timeout_s: float = 5.0  # deadline of each request

    def __post_init__(self):
        _check(1 <= self.replica_num <= max(1, len(self.nodes)), "cache_client.replica_num",
               f"must be between 1 and the number of nodes ({len(self.nodes)})")
        _check(self.timeout_s > 0, "cache_client.timeout_s", "must be > 0")


@dataclass(frozen=True)
class ConductorConfig:
    """The conductor (mooncake/conductor/): placement, early rejection, their SLOs and seeds, and how it
    keeps track of its instances."""

    mode: str = "disaggregated"  # or "colocated": the baseline, each request whole on one decode-role instance
    placement: str = "kvcache-centric"  # or local-cache-aware, least-loaded, round-robin, random
    admission: str = "predictive"  # or early, ttft-only, accept-all
    balancing_threshold: float = 2.0  # fetch the pool's longer prefix when it is this many times the local one
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    control_address: str = "tcp://127.0.0.1:7700"  # instances register, heartbeat and report here
    heartbeat_interval_s: float = 0.5  # told to each instance when it registers
    heartbeat_timeout_s: float = 3.0  # silent this long: the instance is dead, its requests fail
    # An API process silent past the heartbeat timeout keeps its legs this much longer: one that was only
    # slow (an overloaded event loop) registers again and its streams go on; one that is gone has them freed.
    api_grace_s: float = 5.0
    prefill_timeout_s: float = 120.0  # placement to first token, at most
    token_timeout_s: float = 30.0  # longest wait for the next token of a decoding request; then it migrates
    request_deadline_s: float = 900.0  # admission to the last token, at most, whatever happens on the way
    migration_limit: int = 2  # times one request may move to other instances after a failure (0: never)
    # OTLP/HTTP traces endpoint (e.g. http://127.0.0.1:4318/v1/traces): each request's timeline as spans.
    # Empty: a log line per request only. Needs `pip install '.[otel]'`.
    otlp_endpoint: str = ""
    # Seeds of the online models (refitted from measurements): prefill s = c0 + c1*n + c2*n^2 for n new
    # tokens; decode step s = a + b*batch + c*context tokens; KV bandwidth between holders.
    prefill_c0_s: float = 0.02
    prefill_s_per_token: float = 2e-3
    prefill_s_per_token2: float = 1e-7
    decode_step_s: float = 0.03
    decode_s_per_seq: float = 2e-3
    decode_s_per_context_token: float = 1e-6
    bandwidth_bytes_per_s: float = 1e9
    # Every seed above and every instance's own (an emulated instance's exact cost model) is multiplied by
    # this before use: 2 or 0.5 start the conductor from a wrong prior, to see the refits converge.
    estimator_prior_scale: float = 1.0
    # How many tokens a request in flight has left to decode, for Eq. 1's decode load: "learned" (from the
    # lengths of the answers that ended: the client's max_tokens is only a cap; output_tokens_prior until
    # 16 have ended) or "max_tokens" (its max_tokens less what it wrote: right only when every client
    # asks exactly the length it will get, as a replay with ignore_eos does).
    output_lengths: str = "learned"
    output_tokens_prior: int = 256
    # Chunked pipeline parallelism (CPP, DESIGN section 6): a group of cpp_stages prefill instances runs
    # a prompt as a pipeline whose stage k computes layers k*L/X .. (k+1)*L/X - 1, in chunks of
    # cpp_chunk_tokens. 1: no groups. `mooncake simulate`: prefill nodes form static groups; a prompt whose
    # uncached part is over cpp_threshold_tokens is chunked, a shorter one passes as one chunk. Live: for a
    # prompt over cpp_threshold_tokens, Algorithm 1 also weighs a group of the least-loaded instances
    # (which reuses what the cache pool holds of the prompt, never a member's own cache) and picks it when
    # its pipeline is faster: a prompt whose uncached part is short passes the group as one chunk, so one
    # instance wins it.
    cpp_stages: int = 1
    cpp_threshold_tokens: int = 2048
    cpp_chunk_tokens: int = 2048
    # A standby conductor (DESIGN section 13; `pip install '.[ha]'`): with etcd endpoints (http://host:2379),
    # each conductor campaigns for etcd_key under a lease of leader_ttl_s; only the leader listens on
    # control_address (list every conductor in instance.conductor_address). Empty: one conductor, no etcd.
    etcd_endpoints: tuple[str, ...] = ()
    etcd_key: str = "/mooncake/conductor/leader"
    leader_ttl_s: float = 2.0

    def __post_init__(self):
        _check(self.cpp_stages >= 1, "conductor.cpp_stages", "must be >= 1 (1: no CPP groups)")
        _check(self.estimator_prior_scale > 0, "conductor.estimator_prior_scale", "must be > 0")
        _check(self.output_lengths in ("learned", "max_tokens"), "conductor.output_lengths",
               f"must be 'learned' or 'max_tokens', got {self.output_lengths!r}")
        _check(self.output_tokens_prior > 0, "conductor.output_tokens_prior", "must be > 0")
        _check(self.cpp_threshold_tokens >= 0, "conductor.cpp_threshold_tokens", "must be >= 0")
        _check(self.cpp_chunk_tokens > 0, "conductor.cpp_chunk_tokens", "must be > 0")
        _check(self.mode in ("disaggregated", "colocated"), "conductor.mode",
               f"must be 'disaggregated' or 'colocated', got {self.mode!r}")
        _check_known("placement", self.placement, "conductor.placement")
        _check_known("admission", self.admission, "conductor.admission")
        for key in ("balancing_threshold", "ttft_slo_s", "tbt_slo_s", "heartbeat_interval_s",
                    "heartbeat_timeout_s", "prefill_timeout_s", "token_timeout_s", "request_deadline_s",
                    "bandwidth_bytes_per_s"):
            _check(getattr(self, key) > 0, f"conductor.{key}", "must be > 0")
        for key in ("prefill_c0_s", "prefill_s_per_token", "prefill_s_per_token2", "decode_step_s",
                    "decode_s_per_seq", "decode_s_per_context_token"):
            _check(getattr(self, key) >= 0, f"conductor.{key}", "must be >= 0")
        _check(self.api_grace_s >= 0, "conductor.api_grace_s", "must be >= 0")
        _check(self.migration_limit >= 0, "conductor.migration_limit", "must be >= 0")
        _check(not self.otlp_endpoint or self.otlp_endpoint.startswith(("http://", "https://")),
               "conductor.otlp_endpoint", "must be an http(s) URL like http://127.0.0.1:4318/v1/traces")
        _check(self.heartbeat_timeout_s > self.heartbeat_interval_s, "conductor.heartbeat_timeout_s",
               "must be longer than conductor.heartbeat_interval_s")
        _check("://" in self.control_address, "conductor.control_address",
               "must be a ZeroMQ address like tcp://127.0.0.1:7700")
        _check(all(e.startswith(("http://", "https://")) for e in self.etcd_endpoints), "conductor.etcd_endpoints",
               "must be etcd client URLs like http://127.0.0.1:2379")
        _check(self.leader_ttl_s >= 2, "conductor.leader_ttl_s", "must be >= 2 (etcd's shortest lease)")
        _check(self.etcd_key.startswith("/"), "conductor.etcd_key", "must be a key path like /mooncake/leader")


PLACEHOLDER_KEYS = ("change-me", "changeme", "secret", "sk-xxx")  # refused as API keys: a key a reader can guess


@dataclass(frozen=True)
class ApiKeyConfig:
    """One client's API key (`[[api.keys]]`), with limits of its own."""

    key: str = ""
    name: str = ""  # in logs and errors; empty: "key <n>"
    max_concurrent_requests: int = 0  # choices in flight at once; 0: no limit
    max_outstanding_tokens: int = 0  # prompt + max_tokens of its choices in flight; 0: no limit
    # Its requests' prefix cache is its own: the salt enters their block hash chain, so no other client
    # reuses their blocks or learns from `cached_tokens` what they sent; empty: the shared cache.
    cache_salt: str = ""

    def __post_init__(self):
        _check(len(self.key) >= 16 and self.key not in PLACEHOLDER_KEYS, "api.keys[].key",
               "must be a secret of at least 16 characters (`openssl rand -hex 32`)")
        _check(self.max_concurrent_requests >= 0, "api.keys[].max_concurrent_requests", "must be >= 0")
        _check(self.max_outstanding_tokens >= 0, "api.keys[].max_outstanding_tokens", "must be >= 0")


@dataclass(frozen=True)
class ApiConfig:
    """An API process's OpenAI-compatible HTTP endpoint (mooncake/api/; `mooncake serve --role api`). It
    reaches the conductor at instance.conductor_address, and follows conductor.request_deadline_s,
    prefill_timeout_s, token_timeout_s and migration_limit for the requests it streams."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = ""  # non-empty: every /v1 request needs "Authorization: Bearer <api_key>"
    keys: tuple[ApiKeyConfig, ...] = ()  # more keys, each with its own limits and prefix cache ([[api.keys]])
    model_name: str = ""  # the name clients use in "model"; empty: engine.model
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 512  # chat requests that name no max_tokens (capped by the context left)
    strict_fields: bool = True  # a request field this server does not know is a 400 naming it (false: ignored)
    # Host names a request may name when no key is set, beside loopback's and api.host (a web page the
    # user visits cannot then drive a keyless API through DNS rebinding)
    allowed_hosts: tuple[str, ...] = ()
    header_timeout_s: float = 10.0  # a request's headers arrive within this; an idle connection is closed after it
    body_timeout_s: float = 30.0  # a request's body arrives within this once its headers are in
    max_connections: int = 1024  # open client connections at most; past that, a new one gets 503 and is closed
    tls_cert: str = ""  # PEM certificate chain: serve HTTPS (with api.tls_key)
    tls_key: str = ""
    metrics_key: str = ""  # non-empty: /metrics and /health need "Authorization: Bearer <metrics_key>"
    report_address: str = ""  # where instances send its tokens (ZeroMQ); empty: its address toward the conductor
    conductor_wait_s: float = 10.0  # a new request waits this long for an absent conductor, then gets 503
    reuse_port: bool = False  # SO_REUSEPORT: several API processes of this host listen on api.port together
    tokenizer_threads: int = 2  # threads that parse, template and tokenize requests, off the event loop
    stream_interval: int = 1  # tokens per SSE event after the first (more: fewer writes, burstier streams)

    def __post_init__(self):
        _check(0 <= self.port < 65536, "api.port", "must be a TCP port (0 picks a free one)")
        _check(self.default_max_tokens > 0, "api.default_max_tokens", "must be > 0")
        _check(self.max_body_bytes > 0, "api.max_body_bytes", "must be > 0")
        _check(self.api_key not in PLACEHOLDER_KEYS, "api.api_key",
               f"is the placeholder {self.api_key!r}: set a secret of your own (`openssl rand -hex 32`)")
        _check(self.metrics_key not in PLACEHOLDER_KEYS, "api.metrics_key",
               f"is the placeholder {self.metrics_key!r}: set a secret of your own")
        _check(len({k.key for k in self.keys} | ({self.api_key} if self.api_key else set())) ==
               len(self.keys) + bool(self.api_key), "api.keys", "must not repeat a key (api.api_key included)")
        _check(self.header_timeout_s > 0, "api.header_timeout_s", "must be > 0")
        _check(self.body_timeout_s > 0, "api.body_timeout_s", "must be > 0")
        _check(self.max_connections > 0, "api.max_connections", "must be > 0")
        _check(self.conductor_wait_s > 0, "api.conductor_wait_s", "must be > 0")
        _check(self.tokenizer_threads > 0, "api.tokenizer_threads", "must be > 0")
        _check(self.stream_interval > 0, "api.stream_interval", "must be > 0")
        _check(not self.report_address or "://" in self.report_address, "api.report_address",
               "must be a ZeroMQ address like tcp://198.18.0.10:0, or empty")
        _check(bool(self.tls_cert) == bool(self.tls_key), "api.tls_cert",
               "and api.tls_key go together: set both to serve HTTPS, or neither")

    @property
    def is_keyed(self) -> bool:
        return bool(self.api_key or self.keys)


ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class InstanceConfig:
    """A prefill or decode instance: its name, its conductor, and how KV reaches it."""

    instance_id: str = ""  # empty: "<role>-<host name>-<pid>", unique across hosts
    conductor_address: str = "tcp://127.0.0.1:7700"  # several, comma-separated: a leader and its standbys
    transport: str = "tcp"  # KV between prefill and decode: tcp, shm (same host), mooncake, inproc
    data_address: str = ""  # decode's KV inbox, prefill's CPP stage inbox; empty: any free loopback port
    # prefill reads reused blocks from, and writes new ones to, the cache nodes; decode writes a CPP group's
    use_cache_pool: bool = True
    stream_kv: bool = True  # prefill pushes each chunk's KV while computing the next; false: all at the end
    # With stream_kv: each layer's KV of a chunk leaves as soon as that layer is computed, while the next
    # layers compute (the paper's layer-wise streaming), so only the last layer's share of the last
    # chunk lands on TTFT; false: a chunk's blocks leave whole after its step.
    stream_layers: bool = False
    # Decode drops KV no request claimed within this long. 0: conductor.prefill_timeout_s plus the hand-off's
    # HAND_OFF_S (decode/inbox.py): a leg's first blocks may wait as long as its prefill may take.
    kv_inbox_ttl_s: float = 0.0
    kv_inbox_bytes: int = 1 << 30  # decode holds at most this much unclaimed KV (prefill: CPP activations)

    def __post_init__(self):
        _check_known("transports", self.transport, "instance.transport")
        _check("://" in self.conductor_address, "instance.conductor_address",
               "must be a ZeroMQ address like tcp://127.0.0.1:7700")
        _check(self.kv_inbox_ttl_s >= 0, "instance.kv_inbox_ttl_s", "must be >= 0 (0: conductor.prefill_timeout_s)")
        _check(self.kv_inbox_bytes > 0, "instance.kv_inbox_bytes", "must be > 0")
        _check(self.stream_kv or not self.stream_layers, "instance.stream_layers",
               "needs instance.stream_kv = true (layers stream within chunk-wise streaming)")


@dataclass(frozen=True)
class SecurityConfig:
    """Who may talk to the cluster (mooncake/security.py): CURVE with the cluster's key pair."""

    keys_dir: str = ""  # `mooncake keys generate DIR`; every role of the cluster needs the same pair
    insecure: bool = False  # run without keys beyond loopback: only on a network you trust entirely


@dataclass(frozen=True)
class MooncakeConfig:
    """The whole file: one table per component."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    cache_client: CacheClientConfig = field(default_factory=CacheClientConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    conductor: ConductorConfig = field(default_factory=ConductorConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    instance: InstanceConfig = field(default_factory=InstanceConfig)
    sim: SimConfig = field(default_factory=SimConfig)


def _check_known(kind: str, name: str, key: str) -> None:
    """`name` is a backend registered under `kind` (ours or a third party's entry point)."""
    from mooncake.registry import known
    names = known(kind)
    _check(name in names, key, f"must be one of {', '.join(names)}, got {name!r}")


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> MooncakeConfig:
    """Load a TOML file (or the defaults when `path` is None), then apply `overrides`
    given as {"section.key": value}."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    for dotted, value in (overrides or {}).items():
        *parents, leaf = dotted.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return from_dict(MooncakeConfig, data)


def dump_config(config: MooncakeConfig) -> str:
    """TOML text of a whole config (what `mooncake dev` writes for each process it starts)."""
    lines = []
    for section in dataclasses.fields(config):
        lines.append(f"[{section.name}]")
        for f in dataclasses.fields(getattr(config, section.name)):
            lines.append(f"{f.name} = {toml_value(getattr(getattr(config, section.name), f.name))}")
        lines.append("")
    return "\n".join(lines)

"""Backends by name: `module:Class` strings imported on first use, so an optional dependency is only
needed by whoever selects that backend. Third parties add theirs through the `mooncake.backends` entry
point group, named "<kind>.<name>" (e.g. "models.mistral")."""

import importlib
from importlib.metadata import entry_points

from mooncake.errors import BackendError

BACKENDS: dict[str, dict[str, str]] = {
    "models": {
        "llama": "backends.models.llama:LlamaRunner",
        "qwen2": "backends.models.llama:LlamaRunner",
        "emulated": "backends.models.emulated:EmulatedRunner",
    },
    "transports": {
        "inproc": "backends.transports.inproc:InprocTransport",
        "tcp": "backends.transports.tcp:TcpTransport",
        "shm": "backends.transports.shm:ShmTransport",
        "mooncake": "backends.transports.mooncake_te:MooncakeTransport",
    },
    "storage": {
        "dram": "backends.storage.dram:DramTier",
        "ssd": "backends.storage.ssd:SsdTier",
    },
    # Policies are found by name the same way, so config validates them without importing a role.
    "placement": {
        "kvcache-centric": "mooncake.conductor.policies:KVCacheCentricPolicy",
        "local-cache-aware": "mooncake.conductor.policies:LocalCacheAwarePolicy",
        "least-loaded": "mooncake.conductor.policies:LeastLoadedPolicy",
        "round-robin": "mooncake.conductor.policies:RoundRobinPolicy",
        "random": "mooncake.conductor.policies:RandomPolicy",
    },
    "admission": {
        "accept-all": "mooncake.conductor.admission:AcceptAll",
        "ttft-only": "mooncake.conductor.admission:TtftOnly",
        "early": "mooncake.conductor.admission:EarlyRejection",
        "predictive": "mooncake.conductor.admission:PredictiveRejection",
    },
    "eviction": {
        "lru": "mooncake.store.eviction:LRUPolicy",
        "lfu": "mooncake.store.eviction:LFUPolicy",
        "length-aware": "mooncake.store.eviction:LengthAwarePolicy",
    },
}


def known(kind: str) -> list[str]:
    """Every name registered under `kind`: ours, then third parties' entry points."""
    prefix = f"{kind}."
    extra = [ep.name[len(prefix):] for ep in entry_points(group="mooncake.backends") if ep.name.startswith(prefix)]
    return list(BACKENDS.get(kind, {})) + [n for n in extra if n not in BACKENDS.get(kind, {})]


def load_backend(kind: str, name: str):
    """The class registered for `name` under `kind`; a clear BackendError if unknown or not importable."""
    target = BACKENDS.get(kind, {}).get(name) or _entry_point(kind, name)
    if target is None:
        known = ", ".join(sorted(BACKENDS.get(kind, {})))
        raise BackendError(f"unknown {kind} backend '{name}' (known: {known})")
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:  # NOTE: a backend with an optional dependency says how to install it itself
        raise BackendError(f"{kind} backend '{name}' cannot load ({exc})") from None
    return getattr(module, attr)


def _entry_point(kind: str, name: str) -> str | None:
    for ep in entry_points(group="mooncake.backends"):
        if ep.name == f"{kind}.{name}":
            return ep.value
    return None

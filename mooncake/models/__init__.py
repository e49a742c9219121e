"""Model names, fetching and conversion into the cache, and resolving a name or path to a directory."""

from mooncake.models.resolve import ModelSpec, resolve_model

__all__ = ["ModelSpec", "resolve_model"]

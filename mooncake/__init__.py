"""mooncake: KVCache-centric disaggregated LLM serving."""

__all__ = ["LLMEngine", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name):
    # NOTE: lazy, so roles that never run a model (cache, conductor) start without importing torch.
    if name in __all__:
        from mooncake import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'mooncake' has no attribute {name!r}")

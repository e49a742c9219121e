"""mooncake: KVCache-centric disaggregated LLM serving."""

from mooncake.engine import LLMEngine, SamplingParams

__all__ = ["LLMEngine", "SamplingParams"]
__version__ = "0.1.0"

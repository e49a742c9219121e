"""The model engine: paged KV cache, continuous batching, sampling, KV export/import."""

from mooncake.engine.engine import Completion, LLMEngine, RequestOutput
from mooncake.sampling import SamplingParams

__all__ = ["Completion", "LLMEngine", "RequestOutput", "SamplingParams"]

"""Chunked pipeline parallelism (CPP): what a prefill takes on a group of X instances run as a pipeline.

Stage k of a group computes layers k*L/X .. (k+1)*L/X - 1 of every request placed on the group, and only
activations cross stage boundaries. A prompt whose uncached part is longer than the threshold flows
through in chunks, so all stages work on it at once; a shorter one passes through as one chunk. Requests
follow each other through the stages, so a busy pipeline loses nothing to fill and drain; a single long
prompt gets close to X times faster (cost.pipeline_ends):

    prefill(group) = pipeline_ends(the chunks' predicted whole-model times, X, activation hop)[-1]

Algorithm 1 then compares groups by queue + transfer + this, as it compares instances."""

from collections.abc import Callable
from dataclasses import dataclass

from mooncake.cost import pipeline_ends


@dataclass(frozen=True)
class CppSettings:
    stages: int  # instances per group
    threshold_tokens: int  # uncached tokens above which a prompt is chunked
    chunk_tokens: int
    activation_bytes_per_token: int = 8192 * 2  # a stage boundary's hidden state, bf16 (LLaMA3-70B)

    @classmethod
    def from_config(cls, cfg, activation_bytes_per_token: int | None = None) -> "CppSettings | None":
        """From a ConductorConfig; None when CPP is off (groups of one)."""
        if cfg.cpp_stages < 2:
            return None
        extra = {} if activation_bytes_per_token is None else {"activation_bytes_per_token": activation_bytes_per_token}
        return cls(cfg.cpp_stages, cfg.cpp_threshold_tokens, cfg.cpp_chunk_tokens, **extra)

    def chunk_bounds(self, num_tokens: int, reused_tokens: int) -> list[int]:
        """Token offsets where the uncached part's chunks start, and its end."""
        step = self.chunk_tokens if num_tokens - reused_tokens > self.threshold_tokens else num_tokens
        return list(range(reused_tokens, num_tokens, step)) + [num_tokens]

    def hop_s(self, num_tokens: int, bytes_per_s: float) -> float:
        """A chunk of num_tokens's activations crossing one stage boundary."""
        return num_tokens * self.activation_bytes_per_token / bytes_per_s


def pipelined_prefill_s(settings: CppSettings, prefill_s: Callable[[int, int], float], num_tokens: int,
                        reused_tokens: int, bytes_per_s: float, free_s: list[float] | None = None) -> list[float]:
    """When each stage of a group ends its share of a prompt, whose whole-model time for tokens r..n is
    prefill_s(n, r) (the conductor's PrefillTimeModel.predict, the simulator's CostModel.prefill_s);
    free_s: when each stage is free, default 0 (now)."""
    bounds = settings.chunk_bounds(num_tokens, min(reused_tokens, num_tokens))
    chunk_s = [prefill_s(end, start) for start, end in zip(bounds, bounds[1:])]
    hop_s = settings.hop_s(max((end - start for start, end in zip(bounds, bounds[1:])), default=0), bytes_per_s)
    return pipeline_ends(chunk_s, settings.stages, hop_s, free_s)

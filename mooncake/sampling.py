"""Per-request sampling parameters, validated on construction. In the shared layer: the API parses them,
the conductor forwards them, and the engine samples with them."""

from dataclasses import dataclass

import msgspec

from mooncake.errors import InvalidRequestError


MAX_LOGPROBS = 20  # alternatives per token at most (vLLM's default limit)


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """A generated token's log-probability under the model (its raw distribution, before temperature,
    top-k and top-p), and the `SamplingParams.logprobs` likeliest tokens' as (id, logprob), likeliest
    first. Computed where the token is sampled (prefill for the first, decode for the rest) and carried
    on the wire with it."""

    logprob: float
    top: list[tuple[int, float]] = []


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k filter
    seed: int | None = None  # same seed, same tokens, whatever else is in the batch
    stop: tuple[str, ...] = ()  # stop strings; the text ends before the first match
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k likeliest tokens'

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

"""One request inside an engine: its tokens, how many have KV in the cache, and its block table."""

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mooncake.sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None  # per-request RNG, for reproducible sampling
    keep_kv: bool = False  # on finish, hold the blocks until the engine is told to release them
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)  # TokenLogprob per output token, when asked
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprob of prompt token i + 1 at i, when asked
    matcher: object = None  # its grammar's llguidance matcher, for a structured output (engine/grammar.py)
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache or an import
    num_forwarded_tokens: int = 0  # tokens this engine ran through the model for it (recomputes count)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks, in order
    num_registered_blocks: int = 0  # leading blocks already entered in the block pool's hash map
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched_stop: str | None = None
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    num_preemptions: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list (a decode step needs one token)."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether its steps compute its prompt's logprobs: asked for, and no token out yet (a recompute after
        that has them already)."""
        return self.params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


def finish_reason(seq: Sequence, token: int, eos_token_ids: tuple[int, ...], max_model_len: int,
                  tokenizer: Callable) -> str | None:
    """Why `seq` ends with its new `token` ("stop" or "length"); None while it goes on. `tokenizer()`
    gives the tokenizer, called only for a sequence with stop strings."""
    params = seq.params
    if (token in params.stop_token_ids) or (not params.ignore_eos and token in eos_token_ids):
        return "stop"
    if params.stop and _matches_stop(seq, tokenizer):
        return "stop"
    if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


def _matches_stop(seq: Sequence, tokenizer) -> bool:
    # Decode a window wide enough to hold the longest stop string that could end in the new token.
    window = max(len(s) for s in seq.params.stop) + 8
    text = tokenizer().decode(seq.output_token_ids[-window:], skip_special_tokens=False)
    for stop in seq.params.stop:
        if stop in text:
            seq.matched_stop = stop
            return True
    return False

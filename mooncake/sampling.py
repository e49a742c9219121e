"""Per-request sampling parameters, validated on construction. In the shared layer: the API parses them,
the conductor forwards them, and the engine samples with them."""

import logging
import math
from dataclasses import dataclass

import msgspec

from mooncake.errors import InvalidRequestError


log = logging.getLogger(__name__)

MAX_LOGPROBS = 20  # alternatives per token at most (vLLM's default limit)
# NOTE: each bound below keeps one request's cost to the system small, whoever sends it: stop strings are
# matched per token on the API's and the engine's text, stop token ids per token in the engine.
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_STOP_CHARS = 256  # per stop string
MAX_STOP_TOKEN_IDS = 128
MAX_GRAMMAR_CHARS = 1 << 16  # a structured output's grammar: travels in every message of the request
SEED_LIMIT = 2**63  # seeds in [0, SEED_LIMIT): what every wire codec and torch's generator take
INT_LIMIT = 2**31  # counts and token ids are below it (a request's true limits, context and vocabulary, are lower)
# Temperatures in (0, MIN_TEMPERATURE) are raised to it, as vLLM does: logits / 1e-300 overflow to inf and the
# distribution to NaN. Sampling at 0.01 is all but greedy already.
MIN_TEMPERATURE = 0.01


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """A generated token's log-probability under the model (its raw distribution, before temperature,
    top-k and top-p), and the `SamplingParams.logprobs` likeliest tokens' as (id, logprob), likeliest
    first. Computed where the token is sampled (prefill for the first, decode for the rest) and carried
    on the wire with it."""

    logprob: float
    top: list[tuple[int, float]] = []
    rank: int = 0  # the token's rank in its distribution (1: the likeliest), where it was computed; 0: not


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
    # The same for each prompt token after the first (prefill computes them, so the prompt's prefix cache is
    # not used): OpenAI's `echo` with `logprobs`, and vLLM's `prompt_logprobs`.
    prompt_logprobs: int | None = None
    # Structured output: an llguidance grammar (mooncake/engine/grammar.py) every sampled token must follow;
    # the prompt's last `grammar_done` tokens were generated under it already (a leg that resumes).
    grammar: str | None = None
    grammar_done: int = 0
    # The root of the request's block hash chain (hashing.salt_root): 0 shares the prefix cache; a salted
    # request's blocks are its salt's alone, on every role that hashes them.
    prefix_root: int = 0

    def __post_init__(self):
        _check_int("max_tokens", self.max_tokens, 1, INT_LIMIT)
        _check_number("temperature", self.temperature, 0.0)
        if 0 < self.temperature < MIN_TEMPERATURE:
            log.debug("temperature %g raised to %g", self.temperature, MIN_TEMPERATURE)
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        _check_number("top_p", self.top_p, 0.0)
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        # NOTE: top_k and stop_token_ids are at most the vocabulary: checked where the vocabulary is known
        _check_int("top_k", self.top_k, 0, INT_LIMIT)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, SEED_LIMIT)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS + 1)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS + 1)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be true or false, got {self.ignore_eos!r}", "ignore_eos")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}", "stop")
        if any(not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS for s in self.stop):
            raise InvalidRequestError(f"stop strings must be non-empty strings of at most {MAX_STOP_CHARS} "
                                      "characters", "stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got "
                                      f"{len(self.stop_token_ids)}", "stop_token_ids")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, 0, INT_LIMIT)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_int("prefix_root", self.prefix_root, 0, 2**64)
        _check_int("grammar_done", self.grammar_done, 0, INT_LIMIT)
        if self.grammar is not None and (not isinstance(self.grammar, str) or len(self.grammar) > MAX_GRAMMAR_CHARS):
            raise InvalidRequestError(f"a structured output's grammar must be text of at most {MAX_GRAMMAR_CHARS} "
                                      "characters", "grammar")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    """`value` is an int (not a bool) in [low, high)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", name)
    if value < low or high is not None and value >= high:
        where = f"at least {low}" if high is None else f"in [{low}, {high})"
        raise InvalidRequestError(f"{name} must be {where}, got {value}", name)


def _check_number(name: str, value, low: float) -> None:
    """`value` is a finite int or float (not a bool), at least `low`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", name)
    if value < low:
        raise InvalidRequestError(f"{name} must be >= {low:g}, got {value}", name)


class WireSampling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The sampling fields an instance needs, as control messages carry them: their types are checked when
    a message is decoded, their values when `params` builds the SamplingParams. Stop strings stay with the
    API process, which matches them on text. Defaults as SamplingParams'."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: str | None = None
    grammar_done: int = 0
    prefix_root: int = 0

    def params(self, **changes) -> SamplingParams:
        """The SamplingParams these fields give (with `changes`), validated: InvalidRequestError names a
        field out of its bounds."""
        return SamplingParams(**({name: getattr(self, name) for name in self.__struct_fields__} | changes))


def wire_sampling(params: SamplingParams, max_tokens: int, resumed: int = 0) -> WireSampling:
    """`params` as messages carry them, for a leg that may produce `max_tokens`. `resumed`: the tokens
    already generated, at the end of the leg's prompt (decode after prefill, a migrated leg): the grammar
    replays them, and there are no prompt logprobs to compute."""
    return WireSampling(
        max_tokens=max_tokens, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        seed=params.seed, stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
        logprobs=params.logprobs, prompt_logprobs=None if resumed else params.prompt_logprobs,
        grammar=params.grammar, grammar_done=resumed, prefix_root=params.prefix_root)

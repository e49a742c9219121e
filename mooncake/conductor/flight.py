"""A request in the conductor, from admission to its one terminal state, and the errors it can end in.

The terminal-state contract (enforced by Conductor.stream, the one place a request ends):
- every accepted request ends exactly once: finished, or a RequestError to the client, within
  `conductor.request_deadline_s` of admission, whatever fails on the way;
- it ends with `Conductor._end`, which forgets the flight and tells every instance that held any leg of it
  to free what it holds (engine blocks, KV inbox blocks); instances free on their own deadlines too.

A request runs in legs: one prefill, then one decode. When an instance of a leg dies, hangs or fails it,
the request migrates: a new leg resumes from the prompt plus every token already streamed, on other
instances, with a new wire id so that late reports of the old leg are told to cancel, not believed."""

import asyncio
from dataclasses import dataclass, field

from mooncake.conductor.view import Placement
from mooncake.errors import MooncakeError
from mooncake.sampling import SamplingParams, TokenLogprob


class Unavailable(MooncakeError):
    """No live instance can take the request (HTTP 503)."""


class Rejected(MooncakeError):
    """Admission predicts an SLO miss (HTTP 429 with Retry-After)."""

    def __init__(self, reason: str, message: str, retry_after_s: float):
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class RequestError(MooncakeError):
    """The request ended in an error on the way (deadline, refused by an instance, no instance left)."""

    def __init__(self, message: str, is_invalid: bool = False):
        super().__init__(message)
        self.is_invalid = is_invalid


class LegFailed(MooncakeError):
    """A leg cannot go on (its instance died, hung or failed it); the request may migrate. `suspects`
    are the instances not to place the next leg on while others are alive."""

    def __init__(self, message: str, suspects: tuple[str, ...]):
        super().__init__(message)
        self.suspects = suspects


@dataclass(frozen=True)
class StreamEvent:
    text: str  # new text since the last event
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked


@dataclass
class Leg:
    """Where one leg's time went, on the conductor's clock (prefill reports its own split)."""

    wire_id: str
    prefill_id: str
    decode_id: str
    reuse_blocks: int
    placed_s: float
    prefill_done_s: float | None = None
    queue_s: float = 0.0  # prefill's receipt to hand-off, less its compute and pool reads
    fetch_s: float = 0.0  # reading the prefix from the pool
    compute_s: float = 0.0
    kv_transfer_s: float = 0.0  # pushing KV to decode (overlaps compute)
    first_decode_token_s: float | None = None
    ended_s: float | None = None
    failure: str = ""  # why the request left this leg, if it did


@dataclass
class Flight:
    """One request and its current leg, with the inbox its instances' reports land in."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    admitted_s: float  # the conductor's clock
    deadline_s: float  # the conductor's clock: the request ends by then
    # the current leg
    wire_id: str = ""  # the request's id on the wire for this leg
    num_wire_ids: int = 0  # legs sent so far (placements refused at once included): a new id each
    block_hashes: list[int] = field(default_factory=list)  # of this leg's prompt (prompt + generated)
    placement: Placement | None = None
    predicted_prefill_s: float = 0.0
    decode_start_s: float = 0.0  # predicted hand-off to decode (the decode view counts it from then)
    in_prefill: bool = True
    is_decode_sent: bool = False  # decode has claimed the leg's KV from its inbox
    holders: set[str] = field(default_factory=set)  # instances that hold this leg
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    # the whole request
    generated: list[int] = field(default_factory=list)  # every token streamed so far
    num_cached_tokens: int = 0
    num_legs: int = 0
    ended: bool = False  # it reached its terminal state (Conductor._end)
    ttft_s: float = 0.0
    predicted_ttft_s: float = 0.0  # at its first placement
    predicted_tbt_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)  # between consecutive token messages
    legs: list[Leg] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)  # when each token message came

    @property
    def num_completion_tokens(self) -> int:
        return len(self.generated)

    @property
    def num_migrations(self) -> int:
        return max(0, self.num_legs - 1)

    @property
    def leg_token_ids(self) -> list[int]:
        """The prompt of the current leg: the request's prompt and every token already streamed."""
        return self.prompt_token_ids + self.generated

    @property
    def num_leg_tokens(self) -> int:
        """len(leg_token_ids), without building it (every decision reads it for every request in flight)."""
        return len(self.prompt_token_ids) + len(self.generated)


def wire_sampling(params: SamplingParams, max_tokens: int | None = None) -> dict:
    """The sampling fields instances need; stop strings stay here (the conductor matches them on text)."""
    wire = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "seed": params.seed, "ignore_eos": params.ignore_eos, "stop_token_ids": list(params.stop_token_ids),
            "logprobs": params.logprobs, "prefix_root": params.prefix_root}
    return wire if max_tokens is None else {**wire, "max_tokens": max_tokens}

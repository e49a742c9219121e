"""A request in an API process, from admission to its one terminal state (DESIGN section 13).

The terminal-state contract (enforced by FrontDoor.stream, the one place a request ends):
- every accepted request ends exactly once: finished, or a RequestError to the client, within
  `conductor.request_deadline_s` of admission, whatever fails on the way;
- it ends with `FrontDoor._end`, which tells the conductor the leg is over (`LegEnded`), so every
  instance that held it is told to free what it holds; instances free on their own deadlines too.

A request runs in legs: one prefill, then one decode, each placed by the conductor. When an instance of a
leg dies, hangs or fails it, the request migrates: a new leg resumes from the prompt plus every token
already streamed, on other instances, with a new wire id so that late reports of the old leg are told to
cancel, not believed."""

import asyncio
from dataclasses import dataclass, field

from mooncake.messages import HandOff, Placed
from mooncake.sampling import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class StreamEvent:
    text: str  # new text since the last event
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked
    prompt_logprobs: list[TokenLogprob] | None = None  # with the first token: one per prompt token but the first
    tool_calls: list[dict] | None = None  # chat: tool calls whole since the last event (mooncake/api/tools.py)


@dataclass
class Leg:
    """Where one leg's time went, on the API process's clock (prefill reports its own split)."""

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
    admitted_s: float  # the API process's clock
    deadline_s: float  # the API process's clock: the request ends by then
    # the current leg
    wire_id: str = ""  # the request's id on the wire for this leg
    num_wire_ids: int = 0  # legs sent so far (placements refused at once included): a new id each
    block_hashes: list[int] = field(default_factory=list)  # of this leg's prompt (prompt + generated)
    placement: Placed | None = None  # where the conductor put the leg (None until it answers)
    in_prefill: bool = True
    handed_off: HandOff | None = None  # sent to the conductor; no token from decode yet (resent to a new one)
    is_finished: bool = False  # decode finished the leg and freed it itself
    migration: str = ""  # why the request could not move, if that ended it ("limit", "no_instance")
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    # the whole request
    generated: list[int] = field(default_factory=list)  # every token streamed so far
    num_cached_tokens: int = 0
    num_legs: int = 0
    ended: bool = False  # it reached its terminal state (FrontDoor._end)
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


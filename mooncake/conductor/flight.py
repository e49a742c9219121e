"""A request leg in the conductor, from its placement to its end, as Algorithm 1's load view counts it.

The conductor does not own streams (DESIGN section 13): an API process asks it to place a leg (`Place`),
tells it when prefill handed the leg off (`HandOff`, then the conductor sends `Decode`) and when the leg
ended (`LegEnded`); decode's heartbeats say how far each leg got. A `Flight` is what the conductor keeps
of one leg meanwhile: where it runs and what it is predicted to cost there. When an instance of a leg
dies, the conductor tells the leg's API process (`LegLost`), which moves the request."""

from dataclasses import dataclass, field

from mooncake.conductor.view import Placement
from mooncake.sampling import SamplingParams


@dataclass
class Flight:
    """One leg in flight: where it runs, its prediction, and who owns its stream."""

    request_id: str  # the leg's wire id
    prompt_token_ids: list[int]  # the leg's prompt: the request's prompt and every token streamed before it
    params: SamplingParams  # max_tokens: what the leg may produce
    owner: str  # the API process's identity on the control socket
    reply_to: str = ""  # the API process's report address
    block_hashes: list[int] = field(default_factory=list)
    placement: Placement | None = None
    predicted_prefill_s: float = 0.0
    decode_start_s: float = 0.0  # predicted hand-off to decode (the decode view counts it from then)
    in_prefill: bool = True
    is_decode_sent: bool = False  # decode has claimed the leg's KV from its inbox
    is_handed_off: bool = False  # this conductor sent its `Decode`: a HandOff sent again is a duplicate
    num_decoded: int = 0  # tokens decode produced, as its last heartbeat said
    holders: set[str] = field(default_factory=set)  # instances that hold this leg
    placed_s: float = 0.0  # the conductor's clock: the prefill queue counts its work from then

    @property
    def wire_id(self) -> str:
        return self.request_id

    @property
    def num_leg_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.num_decoded

    @property
    def num_tokens_left(self) -> int:
        return max(0, self.params.max_tokens - self.num_decoded)


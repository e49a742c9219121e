"""What the policies see and say: plain dataclasses of ids, counts and times (no live objects)."""

from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(frozen=True)
class RequestView:
    request_id: str
    num_tokens: int  # prompt tokens
    block_hashes: tuple[int, ...]  # chained hashes of the prompt's full blocks
    max_tokens: int = 256  # for the decode-duration estimate
    arrival_s: float = 0.0


@dataclass
class PrefillView:
    instance_id: str
    queued_prefill_s: float = 0.0  # predicted prefill time of the requests queued on it
    num_queued: int = 0
    stages: int = 1  # a CPP group of this many instances run as a pipeline (conductor/cpp.py)
    # A live CPP group: its instances, in stage order (instance_id names the group). Its stages reuse a
    # cached prefix only from the pool (each reads it there), never from a member's own cache. Empty: one
    # instance, or a simulated group (whose pool serves its stages).
    member_ids: tuple[str, ...] = ()


class DecodeLoad(NamedTuple):
    """One request a decode instance has or will have: in its batch from start_s until finish_s. (A named
    tuple: every decision makes one per request in flight, at a fifth of a frozen dataclass's cost.)"""

    start_s: float  # when its KV is (or is predicted to be) in decode: prefill end
    finish_s: float  # predicted end of decoding
    context_tokens: int

    @classmethod
    def ahead(cls, start_s: float, remaining_tokens: int, context_tokens: int, step_s: float) -> "DecodeLoad":
        """What the conductor knows of a request's decoding, the live one and the simulator alike: it
        decodes from `start_s` for the tokens it has left (max_tokens less those streamed; it may stop
        sooner) at its instance's current step time, with the context it has now."""
        return cls(start_s, start_s + remaining_tokens * step_s, context_tokens)


@dataclass
class DecodeView:
    instance_id: str
    requests: list[DecodeLoad] = field(default_factory=list)  # running and placed-but-in-prefill

    def batch_at(self, t: float) -> tuple[int, int]:
        """(batch size, context tokens) predicted at time t."""
        batch = context = 0
        for r in self.requests:
            if r.start_s <= t < r.finish_s:
                batch += 1
                context += r.context_tokens
        return batch, context


@dataclass(frozen=True)
class Placement:
    prefill_id: str
    decode_id: str
    reuse_blocks: int  # leading blocks prefill reads instead of computing
    fetch_from: str | None  # holder the reused blocks come from, when not local (then replicate there)
    ttft_s: float  # estimated: queue + transfer + prefill
    tbt_s: float  # estimated TBT of the decode instance with this request added
    transfer_s: float = 0.0
    stage_ids: tuple[str, ...] = ()  # a live CPP group's instances in stage order (prefill_id: the last)


@dataclass
class ClusterView:
    """A read-only snapshot for one decision."""

    prefills: list[PrefillView]
    decodes: list[DecodeView]
    block_size: int  # tokens per block
    block_bytes: int  # KV bytes per block
    # Holders a prefill instance can read a prefix from. The live system: the cache pool's live nodes
    # (prefill instances do not serve their caches to each other). None: every holder (the simulator,
    # where every node's DRAM serves the pool).
    fetchable: frozenset[str] | None = None


@dataclass(frozen=True)
class Rejection:
    reason: str  # "ttft_slo" | "tbt_slo" | "overload" | "no_instance"
    ttft_s: float = 0.0
    tbt_s: float = 0.0

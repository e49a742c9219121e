"""Every control message mooncake sends over ZeroMQ, typed and versioned, with one msgpack codec.

A message is a frozen msgspec Struct tagged with its type; on the wire it is a msgpack map
{"t": tag, "v": version, **fields}. Decoding checks the tag, the version, the field names and every
field's type (a frame from the network is untrusted until it is decoded), and raises MessageError, so a
malformed or ill-typed message is answered with an ErrorReply and never reaches a handler. Two groups:
the cache role's control messages; those between the conductor and its prefill and decode instances;
and those between the conductor and the API processes (DESIGN section 13: an API process owns its
requests' streams, and instances send a request's reports to the API process named in its `reply_to`)."""

from typing import Any, ClassVar, Union

import msgspec

from mooncake.errors import MooncakeError
from mooncake.sampling import TokenLogprob, WireSampling

VERSION = 7  # 2: logprobs on PrefillDone and Tokens; kv_dtype and time coefficients on Register; 3: StepTokens;
# 4: PrefillStage; 5: reuse_blocks on PrefillStage, pool_first_block on Decode; 6: the front door (API
# processes: Place, Placed, HandOff, LegEnded, LegLost; reply_to on Prefill, PrefillStage and Decode;
# progress on Heartbeat; legs on Register); 7: sampling as a typed WireSampling, not a map; a Heartbeat's
# role reports typed (cache, decode)
_TYPES: dict[str, type] = {}


class MessageError(MooncakeError):
    """A frame that is not a well-formed message of this version."""


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="t", forbid_unknown_fields=True):
    """Base of every message; `TAG` is its type's name on the wire."""

    TAG: ClassVar[str]  # set for every message type at the end of this module
    v: int = VERSION


_encoder = msgspec.msgpack.Encoder()


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(frame) -> Message:
    try:
        msg = _decoder.decode(frame)
    except msgspec.ValidationError as exc:
        raise MessageError(f"invalid message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise MessageError(f"not msgpack: {exc}") from None
    if msg.v != VERSION:
        raise MessageError(f"message {msg.TAG!r} has version {msg.v!r}; this build speaks {VERSION}")
    return msg


# -- cache role (control socket; block bytes go over a transport) --------------------------------------

class Hello(Message, tag="hello"):
    """Client -> cache node: who are you, and where do I send blocks?"""


class HelloReply(Message, tag="hello_reply"):
    node_id: str
    transport: str
    data_address: str
    events_address: str


class Exists(Message, tag="exists"):
    keys: list[int]


class ExistsReply(Message, tag="exists_reply"):
    tiers: list[str | None]  # per key: "dram", "ssd" or None


class MatchPrefix(Message, tag="match_prefix"):
    keys: list[int]


class MatchPrefixReply(Message, tag="match_prefix_reply"):
    tiers: list[str]  # tiers of the leading run held


class Remove(Message, tag="remove"):
    keys: list[int]


class RemoveReply(Message, tag="remove_reply"):
    removed: list[bool]


class Stats(Message, tag="stats"):
    pass


class StatsReply(Message, tag="stats_reply"):
    stats: dict[str, Any] = {}  # counters by name, possibly nested; shown in the conductor's /metrics


class StoreEvents(Message, tag="store_events"):
    """Published in batches by a cache node: (kind, key, tier) with kind "add" or "evict". `seq` counts
    the batches of one run of the node (`epoch`): a gap or a new epoch means the reader missed some and
    must take a snapshot."""

    node_id: str
    events: list[tuple[str, int, str | None]] = []
    epoch: str = ""
    seq: int = 0


class Snapshot(Message, tag="snapshot"):
    """Reader -> cache node: every key you hold, please."""


class SnapshotReply(Message, tag="snapshot_reply"):
    """Every key the node holds (any tier) as of event batch `seq` of `epoch`: later batches apply on top."""

    node_id: str
    epoch: str
    seq: int
    keys: list[int] = []


class ErrorReply(Message, tag="error"):
    error: str


# -- conductor <-> instances (one DEALER per instance to the conductor's ROUTER) -----------------------

class Register(Message, tag="register"):
    """Instance or API process -> conductor, on start (and when a new conductor does not know it): who it
    is, what it runs, where peers send it KV; an API process names the legs it holds (`legs`)."""

    instance_id: str
    role: str  # "prefill", "decode" or "api"
    model_id: str
    block_size: int
    kv_dtype: str  # what its engine runs and its KV blocks hold (engine.dtype, "auto" resolved)
    transport: str = ""  # decode: the transport its KV inbox listens on
    data_address: str = ""
    num_kv_blocks: int = 0
    # What its steps take, when its runner knows (an emulated model): seeds for the conductor's estimators.
    prefill_coef: list[float] = []  # c0, c1, c2 of c0 + c1*(n - r) + c2*(n^2 - r^2)
    decode_coef: list[float] = []  # a, b, c of a + b*batch + c*context
    legs: list["HeldLeg"] = []  # an API process: the legs of its requests (a new conductor counts them)


class HeldLeg(msgspec.Struct, frozen=True, array_like=True):
    """A leg an API process holds, as a conductor that restarted needs it: for its load view, and to free it
    wherever it is held when it ends or its API process dies."""

    request_id: str  # its wire id
    decode_id: str
    num_tokens: int  # its context: the prompt and every token so far
    num_tokens_left: int  # tokens it may still produce
    prefill_ids: list[str] = []  # still in prefill: where
    block_hashes: list[int] = []  # still in prefill: its blocks, which may wait in decode's inbox


class RegisterReply(Message, tag="register_reply"):
    accepted: bool
    error: str = ""
    heartbeat_interval_s: float = 0.5


class Leave(Message, tag="leave"):
    """Instance -> conductor, on a clean stop: take no more work here; fail what is in flight."""

    instance_id: str


class StepSample(msgspec.Struct, frozen=True, array_like=True):
    """One engine step that produced tokens, for the conductor's decode step-time model."""

    batch_size: int
    context_tokens: int
    seconds: float


class EmulatedStep(msgspec.Struct, frozen=True, array_like=True):
    """An emulated runner's step: what it modelled and what it took on this box (how far the box keeps pace)."""

    modelled_s: float
    measured_s: float


class CacheChanges(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A prefill instance's local prefix cache since its last heartbeat, by block hash."""

    added: list[int] = []
    evicted: list[int] = []
    is_snapshot: bool = False  # `added` is its whole prefix cache (after it registered, or a Resync)


class LegProgress(msgspec.Struct, frozen=True, array_like=True):
    request_id: str  # the leg's wire id
    num_tokens: int  # tokens decode produced for it so far


class DecodeLoad(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What only a decode instance reports."""

    num_inbox_blocks: int = 0  # KV blocks pushed to it that no request has claimed yet
    progress: list[LegProgress] = []  # each running leg's


class Heartbeat(Message, tag="heartbeat"):
    """Instance -> conductor, every heartbeat interval: its load and what it measured since the last."""

    instance_id: str
    seq: int = 0  # heartbeats since it registered: a gap means reports were lost
    num_waiting: int = 0
    num_running: int = 0
    num_kv_blocks_used: int = 0  # blocks some request holds (not merely cached)
    num_kv_blocks: int = 0
    step_samples: list[StepSample] = []
    emulated_steps: list[EmulatedStep] = []
    cache: CacheChanges | None = None  # a prefill instance's
    decode: DecodeLoad | None = None  # a decode instance's


class Resync(Message, tag="resync"):
    """Conductor -> instance: its reports had a gap; send the whole prefix cache in the next heartbeat."""


class Prefill(Message, tag="prefill"):
    """Conductor -> prefill: compute this prompt's KV, emit the first token, push the KV to decode."""

    request_id: str
    token_ids: list[int]
    block_hashes: list[int]
    sampling: WireSampling  # without stop strings (the conductor matches those)
    decode_id: str
    decode_transport: str
    decode_address: str
    reuse_blocks: int = 0  # leading blocks the pool holds that this instance should read, not compute
    deadline_s: float = 60.0  # seconds from receipt to finish prefill and hand off
    reply_to: str = ""  # the API process's report address: PrefillDone and RequestFailed go there


class PrefillStage(Message, tag="prefill_stage"):
    """Conductor -> each prefill instance of a CPP group (DESIGN section 6): run stage `stage` of
    `num_stages` of this prompt, its share of the model's layers, chunk by chunk; send each chunk's hidden
    states to the next stage's `next_address` and this stage's layers of the prompt's full blocks to
    decode. The last stage samples the first token and, once every stage's KV is in decode's inbox,
    reports `PrefillDone`; a stage that fails reports `RequestFailed`."""
    request_id: str
    token_ids: list[int]
    block_hashes: list[int]
    sampling: WireSampling
    stage: int
    num_stages: int
    chunk_tokens: int
    decode_id: str
    decode_address: str  # empty: the request ends with its first token, no KV goes to decode
    next_address: str = ""  # the next stage's transport; empty on the last stage
    deadline_s: float = 60.0
    reuse_blocks: int = 0  # leading blocks the pool holds that every stage reads (its layers), not computes
    reply_to: str = ""  # the API process's report address


class PrefillDone(Message, tag="prefill_done"):
    """Prefill -> conductor: the first token is out and the prompt's full blocks are in decode's inbox."""

    request_id: str
    first_token: int
    finish_reason: str | None  # set when the first token already ends the request
    num_cached_tokens: int  # reused from the local cache or the pool
    num_computed_tokens: int  # prompt tokens this instance actually ran through the model
    num_kv_blocks_sent: int
    kv_bytes: int  # sent to decode
    kv_seconds: float
    prefill_seconds: float  # receipt to hand-off, queueing included
    compute_seconds: float  # engine steps that computed this request's prompt
    fetched_bytes: int = 0  # read from the cache pool for reuse
    fetch_seconds: float = 0.0
    first_logprob: TokenLogprob | None = None  # when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token but the first, when asked


class Decode(Message, tag="decode"):
    """Conductor -> decode: continue a request whose prefix KV sits in this instance's inbox."""

    request_id: str
    token_ids: list[int]  # prompt + the first token
    block_hashes: list[int]  # of the prompt's full blocks
    sampling: WireSampling  # max_tokens already counts the first token out
    # Write the prompt's blocks from this one on to the pool once imported (a CPP group's: its stages hold
    # only their layers, so no prefill instance can); None: write none.
    pool_first_block: int | None = None
    reply_to: str = ""  # the API process's report address: Tokens and RequestFailed go there


class Tokens(Message, tag="tokens"):
    """Decode -> conductor: new tokens of one request; `finish_reason` set on its last message."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked
    prompt_logprobs: list[TokenLogprob] | None = None  # with the first token of a colocated leg, when asked


class StepTokens(Message, tag="step_tokens"):
    """Decode -> API process: the `Tokens` of every request of that API process one engine step produced
    for, in one message (one send and one receive per step, not one per request)."""

    reports: list[Tokens]


class Cancel(Message, tag="cancel"):
    """Conductor (or the API process a report went to) -> instance: drop the request and free every block
    it holds."""

    request_id: str
    block_hashes: list[int] = []  # decode: the request's blocks still unclaimed in its KV inbox


class RequestFailed(Message, tag="request_failed"):
    """Instance -> API process (the conductor without `reply_to`): the request cannot go on here, and why."""

    request_id: str
    error: str
    is_invalid: bool = False  # the request itself is unusable here (HTTP 400), not a failure of ours


# -- API process <-> conductor (one DEALER per API process to the conductor's ROUTER) -------------------

class Place(Message, tag="place"):
    """API process -> conductor: place this leg and send it to prefill (Algorithm 1; `admit`: the paper's
    early rejection applies, a new request's first leg). Answered with `Placed`."""

    request_id: str  # the leg's wire id
    token_ids: list[int]  # the prompt and every token already streamed
    block_hashes: list[int]
    sampling: WireSampling  # max_tokens: what the leg may still produce
    admit: bool = True
    avoid: list[str] = []  # instances not to use while others of their role are alive
    deadline_s: float = 60.0  # seconds the request has left
    reply_to: str = ""  # where the leg's instances send its reports
    moved_from: str = ""  # the wire id of the leg it replaces (the request migrates)


class Placed(Message, tag="placed"):
    """Conductor -> API process: where the leg went (its `Prefill` is sent), or why it went nowhere."""

    request_id: str
    prefill_ids: list[str] = []  # one, or a CPP group's stages in order
    decode_id: str = ""
    reuse_blocks: int = 0
    predicted_ttft_s: float = 0.0
    predicted_tbt_s: float = 0.0
    refusal: str = ""  # "": placed; "rejected" (429), "unavailable" (503), "unreachable" (place it again)
    reason: str = ""  # a rejection's reason code
    error: str = ""
    retry_after_s: float = 0.0
    suspects: list[str] = []  # unreachable: the instances to avoid next time


class HandOff(Message, tag="hand_off"):
    """API process -> conductor: the leg's prefill is done (its `PrefillDone`); `go_on`: send `Decode` (the
    request is not over with its first token). Self-contained, so a conductor that restarted meanwhile can
    still hand the leg to decode."""

    done: PrefillDone
    decode_id: str
    token_ids: list[int]  # the leg's prompt and its first token
    block_hashes: list[int]  # of the leg's prompt
    sampling: WireSampling  # max_tokens: what decode may still produce
    go_on: bool = True
    pool_first_block: int | None = None
    reply_to: str = ""


class LegEnded(Message, tag="leg_ended"):
    """API process -> conductor: the leg is over; free it wherever it is still held (`is_finished`: decode
    finished it and freed it itself). With `outcome` the request is over too, and the rest is its record
    for the conductor's metrics; without, a new leg follows (the request migrates)."""

    request_id: str
    is_finished: bool = False
    failure: str = ""
    outcome: str = ""  # "ok", "error" or "cancelled"
    migration: str = ""  # why a failed leg's request could not move: "limit" or "no_instance"
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_legs: int = 1
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    predicted_ttft_s: float = 0.0
    predicted_tbt_s: float = 0.0
    mean_gap_s: float = 0.0  # between token messages
    slow_gap_s: float = 0.0  # the mean of the slowest 10% of gaps (the paper's TBT)
    gap_counts: list[int] = []  # gaps at most each of GAP_BUCKETS_S, then the rest (the TBT histogram)
    gap_sum_s: float = 0.0
    # Who may still hold the leg, and its blocks that may wait unclaimed in decode's inbox: a conductor that
    # does not know the leg (it restarted since it was placed) frees it there all the same.
    holders: list[str] = []
    block_hashes: list[int] = []


GAP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)  # the latency histograms'


class LegLost(Message, tag="leg_lost"):
    """Conductor -> API process: an instance of the leg died or left; move the request (`suspects`: avoid)."""

    request_id: str
    error: str
    suspects: list[str] = []


class Cluster(Message, tag="cluster"):
    """API process -> conductor: the cluster's health and the conductor's metrics, for /health and /metrics."""


class ClusterReply(Message, tag="cluster_reply"):
    health: dict[str, Any] = {}
    metrics: str = ""  # the conductor's Prometheus exposition


for _cls in Message.__subclasses__():
    _cls.TAG = _cls.__struct_config__.tag
    _TYPES[_cls.TAG] = _cls
_decoder = msgspec.msgpack.Decoder(Union[tuple(_TYPES.values())])

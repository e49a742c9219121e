"""Every control message mooncake sends over ZeroMQ, typed and versioned, with one msgpack codec.

A message is a frozen dataclass registered under a tag; on the wire it is a msgpack map
{"t": tag, "v": version, **fields}. Decoding checks tag, version and fields and raises MessageError,
so a malformed message is answered with an ErrorReply, never parsed by position. The cache role's
messages live here now; the conductor's, prefill's and decode's join them."""

import dataclasses
from dataclasses import dataclass, field

import msgpack

from mooncake.errors import MooncakeError

VERSION = 1
_TYPES: dict[str, type] = {}


class MessageError(MooncakeError):
    """A frame that is not a well-formed message of this version."""


def message(tag: str):
    def register(cls):
        cls = dataclass(frozen=True)(cls)
        cls.TAG = tag
        _TYPES[tag] = cls
        return cls
    return register


def encode(msg) -> bytes:
    return msgpack.packb({"t": msg.TAG, "v": VERSION, **dataclasses.asdict(msg)})


def decode(frame) -> object:
    try:
        data = msgpack.unpackb(bytes(frame))
    except (ValueError, msgpack.UnpackException) as exc:
        raise MessageError(f"not msgpack: {exc}") from None
    if not isinstance(data, dict):
        raise MessageError("a message must be a map")
    tag, version = data.pop("t", None), data.pop("v", None)
    cls = _TYPES.get(tag)
    if cls is None:
        raise MessageError(f"unknown message type {tag!r}")
    if version != VERSION:
        raise MessageError(f"message {tag!r} has version {version!r}; this build speaks {VERSION}")
    names = {f.name for f in dataclasses.fields(cls)}
    if set(data) - names:
        raise MessageError(f"message {tag!r} has unknown fields {sorted(set(data) - names)}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise MessageError(f"message {tag!r}: {exc}") from None


# -- cache role (control socket; block bytes go over a transport) --------------------------------------

@message("hello")
class Hello:
    """Client -> cache node: who are you, and where do I send blocks?"""


@message("hello_reply")
class HelloReply:
    node_id: str
    transport: str
    data_address: str
    events_address: str


@message("exists")
class Exists:
    keys: list[int]


@message("exists_reply")
class ExistsReply:
    tiers: list  # per key: "dram", "ssd" or None


@message("match_prefix")
class MatchPrefix:
    keys: list[int]


@message("match_prefix_reply")
class MatchPrefixReply:
    tiers: list[str]  # tiers of the leading run held


@message("remove")
class Remove:
    keys: list[int]


@message("remove_reply")
class RemoveReply:
    removed: list[bool]


@message("stats")
class Stats:
    pass


@message("stats_reply")
class StatsReply:
    stats: dict = field(default_factory=dict)


@message("store_events")
class StoreEvents:
    """Published in batches by a cache node: (kind, key, tier) with kind "add" or "evict"."""

    node_id: str
    events: list = field(default_factory=list)


@message("error")
class ErrorReply:
    error: str

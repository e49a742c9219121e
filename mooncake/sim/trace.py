"""Loads request traces in the Mooncake format: one JSON object per line with `timestamp` (ms),
`input_length`, `output_length` and `hash_ids` (chained block hashes, remapped to integers).
A bad line is a `TraceError` naming the file and line number.

A replay sends each request a prompt made from its hash ids (`trace_prompt`: the same block of tokens for
the same hash, so shared prefixes stay shared); `with_emulated_answers` gives each request the length the
emulated model answers that prompt with under a cap, as the live replay gets it."""

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

from mooncake.errors import MooncakeError


class TraceError(MooncakeError):
    """A trace file is missing or has a malformed line."""


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path) -> list[TraceRequest]:
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    requests = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            request = TraceRequest(timestamp_ms=_int(row, "timestamp"), input_length=_int(row, "input_length"),
                                   output_length=_int(row, "output_length"),
                                   hash_ids=tuple(_ints(row, "hash_ids")))
        except (json.JSONDecodeError, TypeError, ValueError, KeyError) as exc:
            raise TraceError(f"{path}:{number}: bad trace line: {exc}") from None
        requests.append(request)
    if not requests:
        raise TraceError(f"trace {path} holds no requests")
    return requests


def block_tokens(hash_id: int, n: int) -> list[int]:
    """The `n` token ids a replay sends for the block of hash `hash_id` (the same on every run and host)."""
    rng = random.Random(hash_id * 7919 + 17)
    return [rng.randrange(10, 250) for _ in range(n)]


def trace_prompt(hash_ids, block: int, max_input: int) -> list[int]:
    """A replayed request's prompt: its blocks' tokens, the first `max_input` of them (a few if none)."""
    tokens = []
    for hash_id in hash_ids:
        tokens += block_tokens(hash_id, block)
        if len(tokens) >= max_input:
            break
    return tokens[:max_input] or block_tokens(-1, 4)


def with_emulated_answers(requests: list[TraceRequest], max_tokens: int, block: int = 512,
                          model: str = "emulated-llama3-70b") -> list[TraceRequest]:
    """The requests with output_length the tokens `model` answers each one's `trace_prompt` with under the
    cap `max_tokens` (mooncake/answer_lengths.py: what the live replay of that prompt gets)."""
    import tomllib

    from mooncake.answer_lengths import AnswerLengths, answer_token_ids
    from mooncake.models.catalog import CATALOG

    answers = AnswerLengths(tomllib.loads(CATALOG[model].spec_path.read_text())["answers"]["quantiles"])
    ids = answer_token_ids()
    return [replace(r, output_length=min(max_tokens, answers.of_prompt(trace_prompt(r.hash_ids, block, r.input_length),
                                                                       ids)))
            for r in requests]


def _int(row: dict, key: str) -> int:
    if key not in row:
        raise KeyError(f"missing field '{key}'")
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"field '{key}' must be a non-negative number, got {value!r}")
    return int(value)


def _ints(row: dict, key: str) -> list[int]:
    if key not in row:
        raise KeyError(f"missing field '{key}'")
    values = row[key]
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"field '{key}' must be a list of integers")
    return values

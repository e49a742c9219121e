"""Loads request traces in the Mooncake format: one JSON object per line with `timestamp` (ms),
`input_length`, `output_length` and `hash_ids` (chained block hashes, remapped to integers).
A bad line is a `TraceError` naming the file and line number."""

import json
from dataclasses import dataclass
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

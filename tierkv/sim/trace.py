"""Request traces in the Mooncake format, one JSON object per line::

    {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}

Each id in ``hash_ids`` names one ``trace_block_tokens``-token block of the prompt (512 in the
Mooncake release); equal ids mean equal prefixes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class TraceError(ValueError):
    """A trace line is malformed; the message names the line."""


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace: arrival, prompt and output sizes, and its prompt block ids
    (``output_given``: the line has an ``output_length``; without one ``output_tokens`` is 0), and the
    tenant it is served for (a line's optional ``tenant``: the engine's ``cache_salt``)."""

    timestamp_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]
    output_given: bool = True
    tenant: str | None = None


def _check_int(obj: dict, key: str, where: str, *, required: bool = True) -> int:
    value = obj.get(key)
    if value is None and not required:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or \
            (isinstance(value, float) and not value.is_integer()):
        raise TraceError(f"{where}: {key!r} must be a non-negative integer, got {value!r}")
    return int(value)


def parse_trace(lines: Iterable[str], name: str = "trace") -> list[Request]:
    """Parse Mooncake-format JSON lines (blank lines are skipped).

    Block ids may be integers or strings; they are mapped to dense integers in order of first
    appearance.

    Raises:
        TraceError: naming the first malformed line.
    """
    ids: dict[Any, int] = {}
    out: list[Request] = []
    last_ts = -math.inf
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        ts = obj.get("timestamp")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
            raise TraceError(f"{where}: 'timestamp' must be a non-negative number of ms, got {ts!r}")
        if ts < last_ts:
            raise TraceError(f"{where}: timestamp {ts} is earlier than the previous line's {last_ts}")
        last_ts = ts
        n_in = _check_int(obj, "input_length", where)
        n_out = _check_int(obj, "output_length", where, required=False)
        hashes = obj.get("hash_ids")
        if not isinstance(hashes, list) or not all(
                isinstance(h, (int, str)) and not isinstance(h, bool) for h in hashes):
            raise TraceError(f"{where}: 'hash_ids' must be a list of integers or strings")
        blocks = []
        for h in hashes:
            i = ids.get(h)
            if i is None:
                i = ids[h] = len(ids)
            blocks.append(i)
        tenant = obj.get("tenant")
        if tenant is not None and (not isinstance(tenant, str) or not 0 < len(tenant) <= 256):
            raise TraceError(f"{where}: 'tenant' must be a name of 1..256 characters, got {tenant!r}")
        out.append(Request(ts / 1000.0, n_in, n_out, tuple(blocks), obj.get("output_length") is not None, tenant))
    return out


def load_trace(path: str | Path) -> list[Request]:
    """Read a trace file; see :func:`parse_trace`."""
    path = Path(path)
    with path.open(encoding="utf-8") as fh:
        return parse_trace(fh, path.name)

"""Sizes, rates and capacities as people write them: ``8GiB``, ``512MiB``, ``100GB``, ``1e9``, ``4096``,
``25GB/s``, ``5%``."""

from __future__ import annotations

import math
import re

KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": KIB, "mib": MIB, "gib": GIB, "tib": TIB}
_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str) -> int:
    """Parse a byte size; plain numbers are bytes. Raises ``ValueError`` on anything else."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"size must not be negative: {value!r}")
        return int(value)
    m = _RE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (examples: 4096, 512MiB, 8GiB, 100GB, 1e9)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_rate(text: str | int | float) -> float:
    """``"25GB/s"``, ``"3GiB/s"`` or a number -> bytes per second."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        return float(text)
    s = str(text).strip()
    if s.lower().endswith("/s"):
        s = s[:-2]
    return float(parse_size(s))


def parse_capacity(text: str, unique_bytes: int) -> int:
    """A tier capacity: ``"5%"`` of ``unique_bytes`` (a trace's), or a size (see :func:`parse_size`)."""
    s = str(text).strip()
    if s.endswith("%"):
        try:
            pct = float(s[:-1])
        except ValueError:
            raise ValueError(f"not a capacity: {text!r} (examples: 5%, 8GiB)") from None
        if not 0 <= pct <= 100 or not math.isfinite(pct):
            raise ValueError(f"capacity percentage must be within 0-100, got {text!r}")
        return int(unique_bytes * pct / 100.0)
    return parse_size(s)


def format_size(n: int | float) -> str:
    """Format bytes with a binary unit, e.g. ``1.5 GiB``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt_bytes(n: float) -> str:
    """Bytes in binary units to 3 significant digits (the replay's reports)."""
    for unit, div in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n:.0f} B"

"""Sizes, rates and capacities as the replay command line writes them (``8GiB``, ``25GB/s``, ``5%``)."""

from __future__ import annotations

import math
import re

KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": KIB, "mib": MIB, "gib": GIB, "tib": TIB}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int | float) -> int:
    """``"8GiB"``, ``"500MB"``, ``"1e9"`` or a number -> bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return int(text)
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 8GiB, 500MB, 1e9)")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_rate(text: str | int | float) -> float:
    """``"25GB/s"``, ``"3GiB/s"`` or a number -> bytes per second."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    s = str(text).strip()
    if s.lower().endswith("/s"):
        s = s[:-2]
    return float(parse_bytes(s))


def parse_capacity(text: str, unique_bytes: int) -> int:
    """A tier capacity: ``"5%"`` of the trace's unique bytes, or a size (see :func:`parse_bytes`)."""
    s = str(text).strip()
    if s.endswith("%"):
        try:
            pct = float(s[:-1])
        except ValueError:
            raise ValueError(f"not a capacity: {text!r} (examples: 5%, 8GiB)") from None
        if not 0 <= pct <= 100 or not math.isfinite(pct):
            raise ValueError(f"capacity percentage must be within 0-100, got {text!r}")
        return int(unique_bytes * pct / 100.0)
    return parse_bytes(s)


def fmt_bytes(n: float) -> str:
    """Bytes in binary units, 3 significant digits."""
    for unit, div in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n:.0f} B"


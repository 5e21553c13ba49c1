"""What the trace generators share: Poisson arrivals, JSON lines and the check of their token ranges."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator


def poisson_times(rng: random.Random, n: int, rate_per_s: float) -> list[float]:
    """``n`` arrival times (seconds) of a Poisson process of ``rate_per_s``."""
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


def json_lines(requests: Iterable[dict]) -> Iterator[str]:
    """Requests as compact JSON lines."""
    for req in requests:
        yield json.dumps(req, separators=(",", ":"))


def check_ranges(**ranges: tuple[int, int]) -> None:
    """Each ``name=(lo, hi)`` must satisfy ``1 <= lo <= hi``.

    Raises:
        ValueError: naming the first range that does not.
    """
    for name, (lo, hi) in ranges.items():
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must satisfy 1 <= min <= max, got ({lo}, {hi})")

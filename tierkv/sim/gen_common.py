"""What the trace generators share: Poisson arrivals and JSON lines."""

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

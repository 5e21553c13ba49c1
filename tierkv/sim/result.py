"""The figures of one replay run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ReplayResult:
    """Figures of one (policy, capacity) run. Rates are fractions of all prompt tokens; ``wall_s`` is
    elapsed time and ``cpu_s`` the process's CPU time (the figure to compare on a shared machine)."""

    policy: str
    capacity: str
    capacity_bytes: int
    requests: int
    input_tokens: int
    token_hit_rate: float
    tier_hit_rate: dict[str, float]
    bytes_moved: dict[str, int]
    disk_writes_bytes: int
    dropped_bytes: int
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_recompute_p50_s: float
    ttft_recompute_p99_s: float
    wall_s: float
    cpu_s: float = 0.0
    placement: str = ""
    admission: str = ""
    store_offered: int = 0  # missed pages offered to the store gate
    store_skipped: int = 0  # of those, not stored (``predicted`` gate)
    store_idle: int = 0  # of the skipped, stored after their request while the engine was idle
    tenant_hit_rate: dict[str, float] = field(default_factory=dict)  # per tenant, of its prompt tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank; 0 when empty)."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


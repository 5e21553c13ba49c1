"""Monotonic counters of one tier, kept by the placement decisions and read by the stats snapshot."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class TierCounters:
    """Monotonic counters of one tier (capacity and usage are read from the tier at snapshot time)."""

    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    corrupt: int = 0
    errors: int = 0
    bytes_logical: int = 0
    bytes_stored: int = 0
    dropped_unwritten: int = 0
    prefetches: int = 0

    def as_dict(self) -> dict[str, int]:
        """Plain dict of every counter."""
        return asdict(self)

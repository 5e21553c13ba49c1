"""Counters per tier, turned into the snapshot that ``tierkv stats`` and clients read."""

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

    def as_dict(self) -> dict[str, int]:
        """Plain dict of every counter."""
        return asdict(self)


def tier_snapshot(counters: TierCounters, *, capacity: int, used: int, blocks: int, **extra: object) -> dict:
    """One tier's figures: capacity, used, blocks, counters, compression ratio, plus tier-specific extras."""
    d: dict[str, object] = {"capacity_bytes": capacity, "used_bytes": used, "blocks": blocks}
    d.update(counters.as_dict())
    d["compression_ratio"] = (counters.bytes_logical / counters.bytes_stored) if counters.bytes_stored else 1.0
    d.update(extra)
    return d

"""One tier's figures as ``tierkv stats`` and clients read them."""

from __future__ import annotations

from tierkv.cache.counters import TierCounters

__all__ = ["TierCounters", "tier_snapshot"]


def tier_snapshot(counters: TierCounters, *, capacity: int, used: int, blocks: int, **extra: object) -> dict:
    """One tier's figures: capacity, used, blocks, counters, compression ratio, plus tier-specific extras."""
    d: dict[str, object] = {"capacity_bytes": capacity, "used_bytes": used, "blocks": blocks}
    d.update(counters.as_dict())
    d["compression_ratio"] = (counters.bytes_logical / counters.bytes_stored) if counters.bytes_stored else 1.0
    d.update(extra)
    return d

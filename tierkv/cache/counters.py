"""Monotonic counters of one tier, kept by the placement decisions and read by the stats snapshot.

Each counter changes through a named method of :class:`TierCounters`, called by the placement that owns
the tier (or, for the remote tier, which has no placement, by the jobs that move its blocks)."""

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
    foreign: int = 0         # intact values of another namespace (identity) under a key: misses, dropped
    earlier_format: int = 0  # values an earlier tierkv wrote, dropped at start
    errors: int = 0
    bytes_logical: int = 0
    bytes_stored: int = 0
    dropped_unwritten: int = 0
    prefetches: int = 0

    def hit(self, nbytes: int = 0) -> None:
        """A block was served from this tier (``nbytes`` read out of it, where the tier counts them)."""
        self.hits += 1
        self.bytes_out += nbytes

    def miss(self, n: int = 1) -> None:
        """``n`` blocks asked of this tier were not there (or did not arrive)."""
        self.misses += n

    def stored(self, nbytes: int) -> None:
        """A block of ``nbytes`` came into this tier."""
        self.bytes_in += nbytes

    def prefetched(self, n: int) -> None:
        """``n`` loads into this tier started ahead of their requests."""
        self.prefetches += n

    def corrupt_dropped(self, n: int) -> None:
        """``n`` stored values were bad and are dropped."""
        self.corrupt += n

    def foreign_dropped(self, n: int) -> None:
        """``n`` stored values belonged to another namespace than their key's and are dropped."""
        self.foreign += n

    def earlier_dropped(self, n: int) -> None:
        """``n`` stored values of an earlier format are dropped."""
        self.earlier_format += n

    def failed(self, n: int = 1) -> None:
        """``n`` operations on this tier failed."""
        self.errors += n

    def as_dict(self) -> dict[str, int]:
        """Plain dict of every counter."""
        return asdict(self)

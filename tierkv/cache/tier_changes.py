"""The tier copies blocks gain and lose, in the order the tier managers' transitions make them; the
daemon's KV events take them (:meth:`TierChanges.take`). Nothing is kept while no one listens."""

from __future__ import annotations

import time
from collections.abc import Iterable

from tierkv.cache.block import Block

__all__ = ["Change", "TierChanges"]

Change = tuple[Block, str, bool, float]  # block, tier, held (gained) or not (lost), when (monotonic s)


class TierChanges:
    """Changes reported by the managers, kept while :attr:`on` (the lock of the store is held)."""

    def __init__(self) -> None:
        self.on = False
        self._pending: list[Change] = []

    def start(self, records: Iterable[Block]) -> None:
        """Keep changes from now on; the copies the records hold already count as gained now."""
        self.on = True
        now = time.monotonic()
        self._pending.extend((b, tier, True, now) for b in records for tier in b.held())

    def gained(self, b: Block, tier: str) -> None:
        """``b`` has a copy in ``tier`` now."""
        if self.on:
            self._pending.append((b, tier, True, time.monotonic()))

    def lost(self, b: Block, tier: str) -> None:
        """``b`` has no copy in ``tier`` any more."""
        if self.on:
            self._pending.append((b, tier, False, time.monotonic()))

    def take(self) -> list[Change]:
        """The changes reported since the last call, oldest first."""
        out, self._pending = self._pending, []
        return out

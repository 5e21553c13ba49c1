"""What the policies remember about blocks, including ones that left every tier.

One :class:`History` can be shared by the policies of all tiers, so a
block demoted from host to disk keeps its heat and depth, and a block evicted and fetched again
is recognised (TinyLFU's idea of counting beyond the cache). It is bounded: the least recently
seen entries are forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class Record:
    """Per-block memory: raw use count, decayed frequency, time of last use, depth in its chain, its
    parent, how many children it has been seen with, and its branch (see :meth:`History.branch`)."""

    __slots__ = ("count", "freq", "t", "depth", "parent", "children", "branch")

    def __init__(self, t: float, depth: int = 0) -> None:
        self.count = 0
        self.freq = 0.0
        self.t = t
        self.depth = depth
        self.parent: Hashable | None = None
        self.children = 0
        self.branch: Hashable | None = None


class History:
    """A bounded map from block key to :class:`Record`.

    Args:
        max_entries: records kept; the least recently used beyond this are dropped.
    """

    def __init__(self, max_entries: int = 1 << 18) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._rec: OrderedDict[Hashable, Record] = OrderedDict()

    def get(self, key: Hashable) -> Record | None:
        """The record of ``key`` or ``None``; does not refresh it."""
        return self._rec.get(key)

    def record(self, key: Hashable, now: float, parent: Hashable | None = None) -> Record:
        """The record of ``key``, created (with its depth from ``parent``) if new; refreshed."""
        rec = self._rec.get(key)
        if rec is None:
            prec = self._rec.get(parent) if parent is not None else None
            rec = self._rec[key] = Record(now, prec.depth + 1 if prec is not None else 0)
            if len(self._rec) > self.max_entries:
                self._rec.popitem(last=False)
        else:
            self._rec.move_to_end(key)
            prec = self._rec.get(parent) if parent is not None else None
            if prec is not None and rec.depth == 0:
                rec.depth = prec.depth + 1
        if parent is not None and rec.parent is None:
            rec.parent = parent
            if prec is not None:
                prec.children += 1
        return rec

    def branch(self, key: Hashable) -> Hashable:
        """The first block of ``key``'s branch: walking up its chain, the block below the nearest
        ancestor seen with more than one child (or the chain's first block). Requests that share a
        prompt and go their own ways below it have branches of their own. Computed from the parent's
        branch as last computed (a chain is used from its first block on, so that one is current)."""
        rec = self._rec.get(key)
        if rec is None:
            return key
        prec = self._rec.get(rec.parent) if rec.parent is not None else None
        rec.branch = prec.branch if prec is not None and prec.children == 1 and prec.branch is not None else key
        return rec.branch

    def use(self, key: Hashable, now: float, half_life_s: float, parent: Hashable | None = None) -> Record:
        """Count one use of ``key`` at ``now``: ``F <- F * 2^(-dt/half_life) + 1``."""
        rec = self.record(key, now, parent)
        decayed(rec, now, half_life_s)
        rec.freq += 1.0
        rec.count += 1
        return rec

    def seen(self, key: Hashable) -> int:
        """How many uses of ``key`` are remembered (0 if none)."""
        rec = self._rec.get(key)
        return rec.count if rec is not None else 0

    def __len__(self) -> int:
        return len(self._rec)

    def __contains__(self, key: object) -> bool:
        return key in self._rec


def decayed(rec: Record, now: float, half_life_s: float) -> float:
    """Bring ``rec.freq`` forward to ``now`` (in place) and return it."""
    if half_life_s > 0 and rec.freq and now > rec.t:
        rec.freq *= 2.0 ** (-(now - rec.t) / half_life_s)
    rec.t = max(rec.t, now)
    return rec.freq

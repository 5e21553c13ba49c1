"""A sampled shadow: two eviction orders simulated side by side, and which of them is winning.

SHARDS-style spatial sampling: a key is in the sample when a hash of its sampling unit falls below
``rate``, so the sample sees every reference to a fixed few percent of the units. The unit is the
caller's: the attention policy passes a block's branch (the blocks below the point where its chain
parted from other chains), so a sampled conversation or session is seen whole and the orders are
compared on the prefixes they keep rather than block by block. Each order (for example LRU and
a learned score) runs as its own small cache over the sampled keys at ``rate`` times the real tier's
bytes; a reference to a key the small cache holds is a hit for that order, any other reference
inserts it (evicting by the order). The orders are compared on the references where they disagree:
``wins[i][j]`` counts (with an exponential decay over ``window`` sampled references) the references
order ``i`` hit and order ``j`` missed. Another order takes the lead when its wins over the leader
pass the leader's wins over it by more than ``z`` standard deviations of a fair coin
(``z * sqrt(n)`` for ``n`` disagreements), so the tier does not flap between orders on noise.

The tier that owns the shadow evicts by the leader's order. The primitives:

- ``sampled(unit)``: whether the keys of a sampling unit are in the sample.
- ``reference(key, size, parent)``: a sampled key was used in the tier.
- ``resize(nbytes)``: the real tier holds ``nbytes`` when it is full (its capacity).
- ``leader``: index of the order that is winning; ``hits``: the decayed hit counts of each order.

Plain code, no threads and no I/O: the daemon and ``tierkv replay`` run the same shadow.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierkv.cache.policy.base import Policy

_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def key_hash(key: Hashable) -> float:
    """A uniform number in [0, 1) fixed by ``key`` (the same in every process: no salted ``hash``)."""
    if isinstance(key, int):
        x = (key * _GOLDEN) & _MASK
        x ^= x >> 31
        x = (x * 0xBF58476D1CE4E5B9) & _MASK
        x ^= x >> 29
    else:
        raw = key if isinstance(key, (bytes, bytearray)) else repr(key).encode()
        x = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
    return (x >> 11) / float(1 << 53)


def elect(wins: Sequence[Sequence[float]], leader: int, z: float) -> int:
    """The order that leads after ``leader``: the one whose wins over it pass its wins back by the most,
    if by more than ``z`` standard deviations of a fair coin; else ``leader``."""
    best, margin = leader, 0.0
    for i in range(len(wins)):
        if i != leader:
            ahead, behind = wins[i][leader], wins[leader][i]
            over = ahead - behind - z * math.sqrt(ahead + behind)
            if over > margin:
                best, margin = i, over
    return best


class Contest:
    """Sides compared on a hash sample of sampling units: the decayed hits and wins of each, and the side
    that leads (see the module docstring). :class:`Shadow` and the admission shadow are its two kinds.

    Args:
        sides: how many sides (index 0 leads at first).
        rate: fraction of the sampling units sampled, in (0, 1].
        window: comparisons over which hits and wins are counted (exponential decay).
        z: standard deviations by which another side's lead over the leader must pass a coin's.
    """

    def __init__(self, sides: int, rate: float, window: float, z: float) -> None:
        if not 0 < rate <= 1:
            raise ValueError(f"rate must be in (0, 1], got {rate!r}")
        if window < 1 or z < 0:
            raise ValueError("window >= 1 and z >= 0 are needed")
        self.rate, self.z = rate, z
        self.keep = 1.0 - 1.0 / window
        self.hits = [0.0] * sides
        self.wins = [[0.0] * sides for _ in range(sides)]
        self.cap: float | None = None  # bytes each side's small cache may hold; None until the tier is full
        self.leader = 0
        self.references = 0
        self.switches = 0

    def sampled(self, unit: Hashable) -> bool:
        """Whether the keys of sampling unit ``unit`` (a key, or the caller's group of keys) are sampled."""
        return key_hash(unit) < self.rate

    def resize(self, nbytes: int) -> None:
        """The real tier is full at ``nbytes``: the small caches hold ``rate`` times that."""
        self.cap = self.rate * nbytes

    def count(self, hit: Sequence[float]) -> None:
        """One comparison: side ``i`` hit ``hit[i]`` (a block, or a request's blocks); each side wins
        against those that hit less, and the leader is elected again."""
        self.references += 1
        keep = self.keep
        for i, h in enumerate(hit):
            self.hits[i] = self.hits[i] * keep + h
            row = self.wins[i]
            for j in range(len(row)):
                row[j] = row[j] * keep + (h > hit[j])
        best = elect(self.wins, self.leader, self.z)
        if best != self.leader:
            self.leader = best
            self.switches += 1

    def snapshot_of(self, leader: str) -> dict[str, object]:
        """The leader (named ``leader``), the decayed hit and win counts and how often the leader changed
        (for ``tierkv stats``)."""
        return {"leader": leader, "hits": [round(h, 1) for h in self.hits],
                "wins": [[round(w, 1) for w in row] for row in self.wins], "references": self.references,
                "switches": self.switches, "rate": self.rate}


class Shadow(Contest):
    """Orders simulated over a hash sample of the keys; see the module docstring.

    Args:
        orders: one policy per order, empty; the shadow owns them (index 0 leads at first).
        rate: fraction of the keys sampled, in (0, 1].
        window: sampled references over which hits are counted (exponential decay).
        z: standard deviations by which another order's lead over the leader must pass a coin's.
    """

    def __init__(self, orders: Sequence[Policy[Hashable]], rate: float, window: float = 20000.0, z: float = 2.0) -> None:
        super().__init__(len(orders), rate, window, z)
        self.orders = list(orders)
        self.used = [0] * len(self.orders)
        self._sizes: list[dict[Hashable, int]] = [{} for _ in self.orders]

    def reference(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        """A use of the sampled ``key`` (``size`` bytes) in the tier: a hit for each order holding it."""
        hit = [key in order for order in self.orders]
        self.count(hit)
        for i, order in enumerate(self.orders):
            if hit[i]:
                order.on_access(key)
                continue
            self._fit(i, size)
            order.on_insert(key, size, parent)
            order.on_access(key)
            self._sizes[i][key] = size
            self.used[i] += size

    def _fit(self, i: int, size: int) -> None:
        """Evict from order ``i`` by its own choice until ``size`` more bytes fit its small cache."""
        if self.cap is None:
            return
        need = self.used[i] + size - self.cap
        if need <= 0:
            return
        order = self.orders[i]
        for v in order.victims(int(need) + 1) or ():
            self.used[i] -= self._sizes[i].pop(v)
            order.on_remove(v)

    def snapshot(self) -> dict[str, object]:
        """The leader, the decayed hit counts and how often the leader changed (for ``tierkv stats``)."""
        return self.snapshot_of(self.orders[self.leader].name)

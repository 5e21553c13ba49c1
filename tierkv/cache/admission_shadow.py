"""A sampled shadow of a colder tier's admission: the rule's writes against writing every victim.

On a hash sample of the branches (the caller's sampling unit, as for
:class:`~tierkv.cache.policy.shadow.Shadow`), two small caches of ``rate`` times the tier's bytes
are fed by the same victims of the faster tier, both in LRU order: the rule's (a victim goes in
when the rule admitted it) and write-all's (every victim goes in). A victim the tier already holds
goes into both. A sampled key named by a request after it left the faster tier (and before it
leaves again) is a return, a hit in each small cache holding it. One request is one comparison, as
the blocks of one branch come back together: the side whose cache holds more of the request's
returns wins it. The two are compared on the requests where they disagree, with the decayed win
counts and the ``z``-standard-deviation test of the eviction shadow; while write-all leads, the
rule's owner writes every victim (and the shadow keeps asking the rule, so it takes over again once
write-all no longer leads).

Plain code, no threads and no I/O: the daemon and ``tierkv replay`` run the same shadow.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

from tierkv.cache.policy.shadow import Contest

NAMES = ("predicted", "all")  # order 0: the rule's writes; order 1: every victim written


class AdmissionShadow(Contest):
    """The rule and write-all over a sample of a tier's victims; see the module docstring.

    Args:
        rate: fraction of the sampling units sampled, in (0, 1].
        window: requests with sampled returns over which wins are counted (exponential decay).
        z: standard deviations by which one side's lead must pass a coin's to take over.
    """

    def __init__(self, rate: float, window: float = 20000.0, z: float = 3.0) -> None:
        super().__init__(2, rate, window, z)
        self._caches: tuple[OrderedDict[Hashable, int], ...] = (OrderedDict(), OrderedDict())
        self.used = [0, 0]
        self._away: set[Hashable] = set()  # sampled keys out of the faster tier, held by a small cache

    def departed(self, key: Hashable, size: int, written: bool | None) -> None:
        """A sampled ``key`` (``size`` bytes in the tier) left the faster tier: write-all writes it, the
        rule's cache when ``written`` (None: the tier holds a copy, so both keep or take one)."""
        self._away.add(key)
        for i, put in enumerate((written is not False, True)):
            if put and key not in self._caches[i]:
                self._put(i, key, size)
        if key not in self._caches[0] and key not in self._caches[1]:
            self._away.discard(key)

    def requested(self, keys: Iterable[Hashable]) -> None:
        """A request names ``keys``: its sampled keys out of the faster tier are one comparison."""
        away = self._away
        back = [k for k in keys if k in away]
        if not back:
            return
        hit = [0, 0]
        for key in back:
            away.discard(key)
            for i, cache in enumerate(self._caches):
                if key in cache:
                    hit[i] += 1
                    cache.move_to_end(key)
        self.count(hit)

    def _put(self, i: int, key: Hashable, size: int) -> None:
        cache, other = self._caches[i], self._caches[1 - i]
        if self.cap is not None:
            while cache and self.used[i] + size > self.cap:
                old, n = cache.popitem(last=False)
                self.used[i] -= n
                if old not in other:
                    self._away.discard(old)
        cache[key] = size
        self.used[i] += size

    def snapshot(self) -> dict[str, object]:
        """The leader, the decayed hit counts (blocks) and how often the leader changed (for ``tierkv stats``)."""
        return self.snapshot_of(NAMES[self.leader])

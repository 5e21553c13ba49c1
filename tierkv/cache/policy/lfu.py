"""Aged LFU: evicts the block with the lowest exponentially decayed access count."""

from __future__ import annotations

import math
import time
from collections.abc import Hashable

from tierkv.cache.policy.base import Clock, HeapPolicy, Setting, register


@register
class LFUPolicy(HeapPolicy):
    """Least frequently used with aging: each access adds 1 to a count that halves every
    ``half_life_s`` seconds (0 = plain LFU), so old heat fades. Ties go to the older block.

    The decayed count at any common time orders blocks exactly like ``log2(F) + t/half_life``
    frozen at their last access, so heap entries never need refreshing.
    """

    name = "lfu"
    SETTINGS = {
        "half_life_s": Setting(300.0, "seconds for an access count to halve (0 = no aging)", min=0.0),
    }

    def __init__(self, *, clock: Clock = time.monotonic, **kwargs: object) -> None:
        self._freq: dict[Hashable, float] = {}
        self._t: dict[Hashable, float] = {}
        super().__init__(clock=clock, **kwargs)

    def _score(self, key: Hashable) -> float:
        tau = self._settings.number("half_life_s")
        f = self._freq[key]
        return math.log2(f) + self._t[key] / tau if tau > 0 else f

    def _bump(self, key: Hashable, add: float) -> None:
        now, tau = self.clock(), self._settings.number("half_life_s")
        f = self._freq.get(key, 0.0)
        if f and tau > 0:
            f *= 2.0 ** (-(now - self._t[key]) / tau)
        self._freq[key] = f + add
        self._t[key] = now
        self._set_priority(key, self._score(key))

    def on_insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        self.on_remove(key)
        self._add(key, size, parent)
        self._bump(key, 1.0)

    def on_access(self, key: Hashable) -> None:
        if key in self._size:
            self._bump(key, 1.0)

    def _forget(self, key: Hashable) -> None:
        self._freq.pop(key, None)
        self._t.pop(key, None)

    def _settings_changed(self) -> None:
        if self._freq:
            for key in self._size:
                self._set_priority(key, self._score(key))

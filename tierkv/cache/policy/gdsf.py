"""Greedy-Dual-Size-Frequency: frequency times cost per byte, on an inflation clock."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

from tierkv.cache.policy.base import Clock, HeapPolicy, Setting, register

_MIB = float(1 << 20)


@register
class GDSFPolicy(HeapPolicy):
    """Priority ``L + F * C / S`` (Cherkasova 1998): ``F`` accesses while resident, ``C`` the cost of
    a miss (``cost_fn(key, size)`` in seconds, else ``cost``), ``S`` bytes in MiB. ``L`` is the
    priority of the last evicted block, so blocks not used for a while fall below newcomers."""

    name = "gdsf"
    HOOKS = frozenset({"cost_fn"})
    SETTINGS = {
        "cost": Setting(1.0, "miss cost of a block when no cost_fn is given", min=0.0),
    }

    def __init__(self, *, clock: Clock = time.monotonic, cost_fn: Callable[[Hashable, int], float] | None = None,
                 **kwargs: object) -> None:
        self.cost_fn = cost_fn
        self._freq: dict[Hashable, int] = {}
        super().__init__(clock=clock, **kwargs)

    def _bump(self, key: Hashable) -> None:
        f = self._freq[key] = self._freq.get(key, 0) + 1
        size = self._size[key]
        cost = self.cost_fn(key, size) if self.cost_fn else self._settings.number("cost")
        self._set_priority(key, self.level + f * cost * _MIB / max(size, 1))

    def on_insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        self.on_remove(key)
        self._add(key, size, parent)
        self._bump(key)

    def on_access(self, key: Hashable) -> None:
        if key in self._size:
            self._bump(key)

    def _forget(self, key: Hashable) -> None:
        self._freq.pop(key, None)

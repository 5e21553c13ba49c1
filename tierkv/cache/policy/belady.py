"""Belady's OPT: evict the block whose next use is farthest away. Needs the future, so it only
runs in the simulator, as the ceiling the real policies are compared with."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

from tierkv.cache.policy.base import Clock, HeapPolicy, register


@register
class BeladyPolicy(HeapPolicy):
    """Farthest-next-use oracle. ``next_use(key)`` returns when the block is next needed (any
    increasing unit; ``math.inf`` for never) as of the latest ``on_insert``/``on_access`` of it."""

    name = "opt"
    HOOKS = frozenset({"next_use"})
    oracle = True

    def __init__(self, *, clock: Clock = time.monotonic, next_use: Callable[[Hashable], float] | None = None,
                 **kwargs: object) -> None:
        if next_use is None:
            raise ValueError("the opt policy needs next_use (it is only available in the simulator)")
        self.next_use = next_use
        super().__init__(clock=clock, **kwargs)

    def on_insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        self.on_remove(key)
        self._add(key, size, parent)
        self._set_priority(key, -self.next_use(key))

    def on_access(self, key: Hashable) -> None:
        if key in self._size:
            self._set_priority(key, -self.next_use(key))

"""Least recently used: the baseline every serving stack starts from."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable

from tierkv.cache.policy.base import Clock, Policy, Protected, never, register, walk_victims


@register
class LRUPolicy(Policy):
    """Evicts the block used longest ago. O(1) per event; ``victims`` walks from the cold end and
    skips protected blocks."""

    name = "lru"

    def __init__(self, *, clock: Clock = time.monotonic, **kwargs: object) -> None:
        self._order: OrderedDict[Hashable, int] = OrderedDict()  # key -> size, coldest first
        super().__init__(clock=clock, **kwargs)

    def on_insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        if size < 0:
            raise ValueError(f"block size must be >= 0, got {size}")
        self._order[key] = int(size)
        self._order.move_to_end(key)

    def on_access(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self, nbytes: int, protected: Protected = never) -> list[Hashable] | None:
        return walk_victims([self._order.items()], nbytes, protected)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

"""Segmented LRU: blocks used once wait in a probation segment; a second use protects them."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable

from tierkv.cache.policy.base import Clock, Policy, Protected, Setting, never, register, walk_victims


@register
class SLRUPolicy(Policy):
    """Two LRU lists (as SGLang's SLRU). New blocks enter *probation*; a hit there moves them to
    *protected*, which may hold at most ``protected_fraction`` of the resident bytes (its coldest
    blocks fall back to probation; the tier's capacity is taken as the most bytes ever resident). Victims come from probation first, so one-shot scans never
    push out blocks that were used twice. ``on_insert`` is not a use; the second ``on_access``
    in this tier protects a block."""

    name = "slru"
    SETTINGS = {
        "protected_fraction": Setting(0.8, "largest share of resident bytes in the protected segment",
                                      min=0.0, max=1.0),
    }

    def __init__(self, *, clock: Clock = time.monotonic, **kwargs: object) -> None:
        self._prob: OrderedDict[Hashable, int] = OrderedDict()
        self._prot: OrderedDict[Hashable, int] = OrderedDict()
        self._uses: dict[Hashable, int] = {}
        self._prot_bytes = 0
        self._bytes = 0
        self._peak = 0
        super().__init__(clock=clock, **kwargs)

    def on_insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        if size < 0:
            raise ValueError(f"block size must be >= 0, got {size}")
        self.on_remove(key)
        self._prob[key] = int(size)
        self._uses[key] = 0
        self._bytes += int(size)
        self._peak = max(self._peak, self._bytes)

    def on_access(self, key: Hashable) -> None:
        if key in self._prot:
            self._prot.move_to_end(key)
        elif key in self._prob:
            uses = self._uses[key] = self._uses[key] + 1
            if uses < 2:
                self._prob.move_to_end(key)
                return
            size = self._prob.pop(key)
            self._prot[key] = size
            self._prot_bytes += size
            self._rebalance()

    def _rebalance(self) -> None:
        limit = self._settings.number("protected_fraction") * self._peak
        while self._prot_bytes > limit and self._prot:
            key, size = self._prot.popitem(last=False)
            self._prot_bytes -= size
            self._prob[key] = size  # most recent end of probation

    def on_remove(self, key: Hashable) -> None:
        self._uses.pop(key, None)
        size = self._prob.pop(key, None)
        if size is None:
            size = self._prot.pop(key, None)
            if size is None:
                return
            self._prot_bytes -= size
        self._bytes -= size

    def victims(self, nbytes: int, protected: Protected = never) -> list[Hashable] | None:
        return walk_victims([self._prob.items(), self._prot.items()], nbytes, protected)

    def _settings_changed(self) -> None:
        self._rebalance()

    def __len__(self) -> int:
        return len(self._prob) + len(self._prot)

    def __contains__(self, key: object) -> bool:
        return key in self._prob or key in self._prot

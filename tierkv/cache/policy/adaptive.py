"""The attention score with a frequency weight learned online from the tier's own victims.

The score is the ``attention`` one with the frequency factor raised to a weight ``w``::

    priority = L + (F'^w * B * R + gamma * A) * P * C / S

Each block the policy evicts goes on a ghost list (as many entries as the tier holds blocks,
times ``ghost_ratio``) with its class (used once, or used more often) and the time it left. A
ghost inserted again counts a return for its class; one that falls off the list counts a return
if the shared history saw a use of it since it left (a disk victim recomputed into host), else a
miss. The return rates of the two classes (counts decayed over ``window`` victims) steer ``w``:
each resolved victim moves it by ``adapt_step * (r_reused - r_once) / (r_reused + r_once)``, down
when once-used victims come back more often than reused ones (the frequency term keeps the wrong
blocks), up otherwise, within ``weight_min``..``weight_max``. This is ARC's idea (move toward the
side whose ghosts are hit) with rates instead of counts, since most victims of a frequency-weighted
score are once-used blocks whatever the trace.

Resident blocks keep the aging clock ``L`` (under ``idle_aging``, the time) they were scored at, so
a change of ``w`` re-scores them without losing their order by age; re-scoring all of them waits
until the tier has seen as many outcomes as an eighth of its blocks since the last one (amortised
O(1) per event).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

from tierkv.cache.policy.attention import AttentionPolicy
from tierkv.cache.policy.base import Clock, Setting, register
from tierkv.cache.reuse.history import History


@register
class AdaptivePolicy(AttentionPolicy):
    """The ``attention`` score with a learned frequency weight (module docstring)."""

    name = "adaptive"
    SETTINGS = {
        **AttentionPolicy.SETTINGS,
        "freq_weight": Setting(1.0, "starting exponent of the frequency factor F'", min=0.0),
        "weight_min": Setting(0.0, "lowest learned frequency weight", min=0.0),
        "weight_max": Setting(2.0, "highest learned frequency weight", min=0.0),
        "adapt_step": Setting(0.01, "change of the weight per resolved victim (0 = fixed weight)", min=0.0),
        "window": Setting(8192, "victims the return rates follow (their counts decay by 1 - 1/window)",
                          min=1),
        "ghost_ratio": Setting(1.0, "evicted blocks remembered, as a multiple of the resident ones",
                               min=0.0),
    }

    def __init__(self, *, clock: Clock = time.monotonic, cost_fn: Callable[[Hashable, int], float] | None = None,
                 history: History | None = None, reuse: Callable[[Hashable], float] | None = None,
                 **kwargs: object) -> None:
        self._parts: dict[Hashable, tuple[float, float, float, float, float]] = {}
        self._ghost: OrderedDict[Hashable, tuple[int, float]] = OrderedDict()  # key -> (class, evicted at)
        self._back = [0.0, 0.0]
        self._gone = [0.0, 0.0]
        self._since = 0
        super().__init__(clock=clock, cost_fn=cost_fn, history=history, reuse=reuse, **kwargs)

    def _settings_changed(self) -> None:
        self.weight = self._settings.number("freq_weight")
        self._applied = self.weight
        super()._settings_changed()

    def _combine(self, key: Hashable, freq: float, br: tuple[float, float], extra: float, p: float,
                 cost: float) -> float:
        head, base = br[0] * br[1], self._aging_base()
        self._parts[key] = (base, freq, head, p * cost, extra)
        return self._aged(key, base, (freq ** self.weight * head + extra) * p * cost)

    # -- learning -------------------------------------------------------------------------------
    def rates(self) -> tuple[float, float]:
        """The return rates of once-used and of reused victims (decayed counts, prior 1/2)."""
        back, gone = self._back, self._gone

        def rate(c: int) -> float:
            return (back[c] + 1.0) / (back[c] + gone[c] + 2.0)
        return rate(0), rate(1)

    def _outcome(self, cls: int, returned: bool) -> None:
        s = self._settings
        keep = 1.0 - 1.0 / s.number("window")
        for c in (0, 1):
            self._back[c] *= keep
            self._gone[c] *= keep
        (self._back if returned else self._gone)[cls] += 1.0
        once, reused = self.rates()
        step = s.number("adapt_step") * (reused - once) / (reused + once)
        self.weight = min(max(self.weight + step, s.number("weight_min")), s.number("weight_max"))
        self._since += 1
        if abs(self.weight - self._applied) >= 0.05 and self._since * 8 >= len(self._size):
            self._reweigh()

    def _reweigh(self) -> None:
        """Re-score every resident block with the current weight, at the clock it was scored at."""
        w = self._applied = self.weight
        self._since = 0
        for key, (base, freq, head, pc, extra) in self._parts.items():
            self._prio[key] = self._aged(key, base, (freq ** w * head + extra) * pc)
        self._compact()

    # -- events ---------------------------------------------------------------------------------
    def on_insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        ghost = self._ghost.pop(key, None)
        if ghost is not None:
            self._outcome(ghost[0], True)
        super().on_insert(key, size, parent)

    def on_remove(self, key: Hashable) -> None:
        if key in self._last_victims and key in self._size:
            rec = self.history.get(key)
            self._ghost[key] = (int(rec is not None and rec.count >= 2), self.clock())
            limit = max(16, int(self._settings.number("ghost_ratio") * len(self._size)))
            while len(self._ghost) > limit:
                old, (cls, t) = self._ghost.popitem(last=False)
                # a block used again in another tier (a disk victim recomputed into host) returned too
                orec = self.history.get(old)
                self._outcome(cls, orec is not None and orec.t > t)
        super().on_remove(key)

    def _forget(self, key: Hashable) -> None:
        self._parts.pop(key, None)
        super()._forget(key)

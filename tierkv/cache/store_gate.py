"""Which of a request's new blocks are worth storing: the store gate.

Storing a block costs the engine's step a copy and the daemon a commit, an encode and a disk write, on
cores the forward pass needs; it pays only if a later request reads the block back. The gate learns, per
class of blocks (a namespace and the root its request's chain starts from: a tenant's ``cache_salt``,
an adapter) and per position bucket in the request's chain (0, 1, 2-3, 4-7, ... blocks from the start),
how often a block offered for storing comes back, and stores a request's blocks while the chance
of a return times the seconds recomputing the block costs beats the seconds storing it costs::

    p(class, bucket) * recompute_s(block) >= store_s(block)

A return is seen two ways, so that a skipped block teaches the gate as much as a stored one: a stored
block served for the first time (:meth:`StoreGate.read`), and a block offered again (its request
recomputed it because it was skipped, or because it was stored and has since left every tier). A block
offered again is stored then, whatever its bucket's estimate, where storing costs less than recomputing
it: its reuse is no longer a guess, and a workload without reuse never offers a block twice. Every
offered block is remembered in a ghost list of ``ghost_entries`` keys with its class and bucket; the
estimate is ``(returns + prior * prior_weight) / (offers + prior_weight)`` over counts that halve every
``half_life`` offers of the bucket, so a workload without reuse stops being stored within
``prior_weight * (prior / threshold - 1)`` offers of a bucket, and one that turns to reuse is stored
again once ``threshold`` of the bucket's recent offers came back.

The blocks stored are a leading run of the offer: a chain is only read back through its prefix, so
the first bucket that does not pay ends what a request stores (the caller stops storing that request).

A second, longer run is stored only when the engine is idle: after its request ends, if no other
request is waiting or running, the connector stores it then (a copy out of pages vLLM frees after it,
on cores with nothing else to do). It runs while the estimate with ``idle_prior_weight`` in place of
``prior_weight`` pays, so an idle engine stores more of a workload's first requests (the returns a gate
that learns from returns cannot foresee) and a workload without reuse still stops being stored, after
``idle_prior_weight * (prior / threshold - 1)`` offers of a bucket (0: nothing is stored when idle).
Plain code, no threads and no I/O: the daemon and ``tierkv replay`` both drive it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from tierkv.cache.knobs import Setting, checked_settings

MODES = ("predicted", "all")
BUCKETS = 9  # position buckets: 0, 1, 2-3, 4-7, ..., 128 and beyond
MAX_CLASSES = 4096


def bucket(position: int) -> int:
    """The bucket of a block ``position`` blocks from the start of its chain."""
    return 0 if position <= 0 else min(BUCKETS - 1, position.bit_length())


@dataclass(slots=True)
class GateCounters:
    """Blocks offered, stored and skipped as unlikely to pay, and returns seen (monotonic)."""

    offered: int = 0
    stored: int = 0
    skipped: int = 0
    idle: int = 0  # of the skipped, blocks in the run stored if the engine is idle when their request ends
    returns: int = 0


@dataclass(frozen=True, slots=True)
class BlockCosts:
    """What a block of one namespace costs: ``recompute_s(position)``, seconds recomputing the block
    ``position`` blocks from its chain's start takes, and ``store_s``, seconds storing it takes (the
    engine's copy, the commit, the encode and the disk write)."""

    recompute_s: Callable[[int], float]
    store_s: float


class StoreGate:
    """The store gate of one daemon (see the module docstring).

    Args:
        mode: ``predicted`` (the default) or ``all`` (every block is stored; the gate only counts).
        **settings: see ``SETTINGS``.
    """

    SETTINGS = {
        "prior": Setting(0.3, "return chance assumed for a bucket with no offers yet", min=0.0, max=1.0),
        "prior_weight": Setting(1.0, "offers the prior weighs as", min=0.1),
        "idle_prior_weight": Setting(3.0, "offers the prior weighs as for stores while the engine is idle "
                                     "(0: none)", min=0.0),
        "half_life": Setting(256.0, "offers of a bucket over which its counts halve", min=16.0),
        "ghost_entries": Setting(1 << 17, "offered keys remembered to see them come back", min=16),
        "min_return": Setting(0.05, "a bucket returning less often than this is never stored, whatever the "
                              "costs say", min=0.0, max=1.0),
    }

    def __init__(self, mode: str = "predicted", **settings: object) -> None:
        if mode not in MODES:
            raise ValueError(f"store gate mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self._settings = checked_settings(self.SETTINGS, {k: s.default for k, s in self.SETTINGS.items()},
                                          settings, "store gate")
        self._ghosts: OrderedDict[Hashable, tuple[Hashable, int]] = OrderedDict()
        self._counts: OrderedDict[Hashable, list[list[float]]] = OrderedDict()  # class -> [offers, returns] per bucket
        self.c = GateCounters()

    # ---- settings ---------------------------------------------------------------------------------
    def update(self, mode: str | None = None, **settings: object) -> None:
        """Change the mode or settings (checked first; a bad one changes nothing)."""
        if mode is not None and mode not in MODES:
            raise ValueError(f"store gate mode must be one of {', '.join(MODES)}, got {mode!r}")
        self._settings = checked_settings(self.SETTINGS, self._settings, settings, "store gate")
        self.mode = mode or self.mode

    # ---- learning ---------------------------------------------------------------------------------
    def _class(self, cls: Hashable) -> list[list[float]]:
        counts = self._counts.get(cls)
        if counts is None:
            counts = self._counts[cls] = [[0.0, 0.0] for _ in range(BUCKETS)]
            while len(self._counts) > MAX_CLASSES:
                self._counts.popitem(last=False)
        else:
            self._counts.move_to_end(cls)
        return counts

    def _returned(self, key: Hashable) -> None:
        """``key`` came back: a return for the class and bucket it was offered in (once per offer)."""
        seen = self._ghosts.pop(key, None)
        if seen is None:
            return
        cls, b = seen
        counts = self._counts.get(cls)
        if counts is not None:
            counts[b][1] += 1.0
        self.c.returns += 1

    def read(self, key: Hashable) -> None:
        """A stored block was served (its first read since it was offered counts as a return)."""
        if key in self._ghosts:
            self._returned(key)

    # ---- deciding ---------------------------------------------------------------------------------
    def chance(self, cls: Hashable, b: int, idle: bool = False) -> float:
        """The estimated chance that a block of ``cls`` in bucket ``b`` comes back (``idle``: weighing the
        prior as ``idle_prior_weight``)."""
        s = self._settings
        counts = self._counts.get(cls)
        offers, returns = (counts[b][0], counts[b][1]) if counts is not None else (0.0, 0.0)
        w = s.number("idle_prior_weight" if idle else "prior_weight")
        return (returns + s.number("prior") * w) / (offers + w) if offers + w > 0 else 0.0

    def threshold(self, costs: BlockCosts, position: int) -> float:
        """The chance of a return a block at ``position`` needs to be worth storing."""
        rc = costs.recompute_s(position)
        need = costs.store_s / rc if rc > 0 else 1.0
        return max(self._settings.number("min_return"), min(1.0, need))

    def pays(self, cls: Hashable, position: int, costs: BlockCosts, idle: bool = False) -> bool:
        """Whether a block of ``cls`` at ``position`` is worth storing now (``idle``: while the engine is
        idle; ``all``: always)."""
        return self.mode == "all" or self.chance(cls, bucket(position), idle) >= self.threshold(costs, position)

    def offer(self, cls: Hashable, keys: Sequence[Hashable], first: int, costs: BlockCosts,
              cut: bool = False) -> int:
        """A request's new blocks ``keys`` (positions ``first`` on) are offered for storing: learn from
        the ones seen before, remember them all, and return how many leading ones to store (``cut``:
        none, the request stopped storing earlier; offered only to learn from)."""
        return self.decide(cls, keys, first, costs, cut)[0]

    def decide(self, cls: Hashable, keys: Sequence[Hashable], first: int, costs: BlockCosts,
               cut: bool = False) -> tuple[int, int]:
        """As :meth:`offer`, and how many leading keys to store if the engine is idle when the request
        ends (at least the first number, whatever ``cut`` says: the caller keeps its idle run going only
        while it continues)."""
        counts = self._class(cls)
        back = [key in self._ghosts for key in keys]
        for key, seen in zip(keys, back):
            if seen:
                self._returned(key)
        def keeps(i: int, idle: bool) -> bool:  # a block offered again is stored where that costs less
            return self.pays(cls, first + i, costs, idle) or (back[i] and costs.store_s < costs.recompute_s(first + i))

        n = 0
        while not cut and n < len(keys) and keeps(n, False):
            n += 1
        later = n
        while self._settings.number("idle_prior_weight") > 0 and later < len(keys) and keeps(later, True):
            later += 1
        ghosts, limit = self._ghosts, int(self._settings.number("ghost_entries"))
        keep = 0.5 ** (1.0 / self._settings.number("half_life"))
        for i, key in enumerate(keys):
            b = bucket(first + i)
            pair = counts[b]
            pair[0] = pair[0] * keep + 1.0
            pair[1] *= keep
            ghosts[key] = (cls, b)
        while len(ghosts) > limit:
            ghosts.popitem(last=False)
        self.c.offered += len(keys)
        self.c.stored += n
        self.c.skipped += len(keys) - n
        self.c.idle += later - n
        return n, later

    def snapshot(self) -> dict[str, object]:
        """Mode, counters, and per position bucket the share of offered blocks that came back, over every
        class (``None`` where nothing was offered)."""
        buckets = []
        for b in range(BUCKETS):
            offers = sum(c[b][0] for c in self._counts.values())
            returns = sum(c[b][1] for c in self._counts.values())
            buckets.append(round(returns / offers, 4) if offers else None)
        return {"mode": self.mode, "offered": self.c.offered, "stored": self.c.stored, "skipped": self.c.skipped,
                "idle": self.c.idle, "returns": self.c.returns, "classes": len(self._counts), "return_rate_by_position": buckets}

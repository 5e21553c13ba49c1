"""Predicted reuse: the chance that a block leaving a tier is requested again, learned online.

Blocks are grouped in classes; a ghost list remembers, for each block that left the tier, its
class at that moment (bounded: about as many entries as the tier holds blocks, so a return counts
only while keeping the block would have paid). A later request or store of the key counts a
*return* for its class; a key that falls off the ghost list counts a *miss*. The estimate of a
class is ``(returns + 2 * prior) / (returns + misses + 2)``. A class is

- the block's past uses (1, 2, 3 or more),
- whether it is the tail of its chain (the last block of the request it was last seen in, which
  no later request has extended yet; ``request_finished`` marks a finished request's tail),
- whether its chain is live (requested or finished within ``tail_ttl_s``),
- the length of that chain (log2 buckets).

Plain code, no threads and no I/O. Keys are any hashable (the simulator's pages, the daemon's
fingerprinted keys). The admission rule (:mod:`tierkv.policy.placement`) and, through ``reuse``,
the attention policy use it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from tierkv.policy.base import Setting, checked_settings
from tierkv.policy.history import History


class _Chain:
    """The last request a block was seen in: its length, its tail, when it was last used."""

    __slots__ = ("length", "t", "tail")

    def __init__(self, length: int, t: float, tail: Hashable | None) -> None:
        self.length, self.t, self.tail = length, t, tail


class ReuseModel:
    """Learns per block class how often blocks that left a tier come back (module docstring).

    Args:
        history: use counts; a private one is made if ``None``.
        **settings: see ``SETTINGS``.
    """

    SETTINGS = {
        "tail_ttl_s": Setting(600.0, "a requested or finished chain counts as live this long", min=0.0),
        "ghost_entries": Setting(1 << 16, "departures remembered to learn which classes come back", min=16),
        "prior": Setting(0.5, "return probability assumed for a class not seen yet", min=0.0, max=1.0),
    }

    def __init__(self, history: History | None = None, **settings: Any) -> None:
        self.history = history if history is not None else History()
        self._settings = {k: s.default for k, s in self.SETTINGS.items()}
        self.update(**settings)
        self._chain: OrderedDict[Hashable, _Chain] = OrderedDict()
        self.depth: dict[Hashable, int] = {}
        self._ghost: OrderedDict[Hashable, int] = OrderedDict()
        self._back: dict[int, float] = {}
        self._gone: dict[int, float] = {}
        self.returns = 0
        self.finished = 0

    # -- signals --------------------------------------------------------------------------------
    def requested(self, keys: Sequence[Hashable], now: float) -> None:
        """A request named ``keys`` (its prefix chain, in order): one use each; ghosts return."""
        if not keys:
            return
        chain = _Chain(len(keys), now, keys[-1])
        chains, depth, use = self._chain, self.depth, self.history.use
        for d, key in enumerate(keys):
            use(key, now, 0.0)
            old = chains.get(key)
            if old is not None and old.tail == key and old is not chain:
                old.tail = None  # the chain it ended is extended by this request
            chains[key] = chain
            chains.move_to_end(key)
            depth[key] = d
        self._returned(keys)
        self._trim()

    def request_finished(self, keys: Sequence[Hashable], now: float) -> None:
        """``keys`` (a chain, in order) finished a request: a conversation tail that may be extended."""
        if not keys:
            return
        self.finished += 1
        chain = self._chain.get(keys[-1])
        if chain is None:
            self.requested(keys, now)
            chain = self._chain[keys[-1]]
        chain.t, chain.tail = now, keys[-1]

    def stored(self, keys: Sequence[Hashable], now: float) -> None:
        """``keys`` (a chain, in order) were stored: a use for those no request named; a key on the
        ghost list counts a return (it was dropped and computed again)."""
        fresh = [k for k in keys if k not in self._chain]
        self._returned(keys)
        if fresh:
            self.requested(fresh, now)

    def left(self, key: Hashable, now: float, horizon: int | None = None) -> None:
        """``key`` left the tier (evicted, demoted or dropped): remember its class. ``horizon``: how
        many departures to remember (the blocks the tier holds now), instead of ``ghost_entries``."""
        ghost = self._ghost
        ghost[key] = self.block_class(key, now)
        ghost.move_to_end(key)
        limit = self._settings["ghost_entries"] if horizon is None else max(16, horizon)
        while len(ghost) > limit:
            _, old = ghost.popitem(last=False)
            self._gone[old] = self._gone.get(old, 0.0) + 1.0

    def _returned(self, keys: Sequence[Hashable]) -> None:
        ghost, back = self._ghost, self._back
        for key in keys:
            cls = ghost.pop(key, None)
            if cls is not None:
                back[cls] = back.get(cls, 0.0) + 1.0
                self.returns += 1

    def _trim(self) -> None:
        cap = 2 * self._settings["ghost_entries"]
        while len(self._chain) > cap:
            key, _ = self._chain.popitem(last=False)
            self.depth.pop(key, None)

    # -- estimates ------------------------------------------------------------------------------
    def block_class(self, key: Hashable, now: float) -> int:
        """The class a block is learned in (see the module docstring)."""
        uses = min(self.history.seen(key), 3)
        chain = self._chain.get(key)
        if chain is None:
            return uses * 64
        live = now - chain.t <= self._settings["tail_ttl_s"]
        tail = chain.tail == key
        return uses * 64 + (tail * 2 + live) * 8 + min(chain.length.bit_length(), 7)

    def class_p(self, cls: int) -> float:
        """The learned chance that a block of class ``cls`` comes back."""
        back, gone = self._back.get(cls, 0.0), self._gone.get(cls, 0.0)
        return (back + 2.0 * self._settings["prior"]) / (back + gone + 2.0)

    def p(self, key: Hashable, now: float) -> float:
        """The learned chance that ``key`` comes back once it leaves the tier."""
        return self.class_p(self.block_class(key, now))

    def predictor(self, clock: Callable[[], float]) -> Callable[[Hashable], float]:
        """``key -> p(key, clock())``: what a policy's ``reuse`` hook takes."""
        return lambda key: self.p(key, clock())

    def snapshot(self) -> dict[str, Any]:
        """Counters and the learned classes."""
        classes = {str(c): round(self.class_p(c), 3) for c in sorted(set(self._back) | set(self._gone))}
        return {"returns": self.returns, "finished_requests": self.finished, "ghost": len(self._ghost),
                "classes": classes}

    # -- settings -------------------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """The effective settings (a copy)."""
        return dict(self._settings)

    def update(self, **settings: Any) -> None:
        """Change settings; a bad key or value raises ``ValueError`` and changes nothing."""
        self._settings = checked_settings(self.SETTINGS, self._settings, settings, "reuse model")

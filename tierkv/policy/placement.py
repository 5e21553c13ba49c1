"""Placement across the tier stack: which blocks leaving a faster tier are written to a colder one.

Admission by predicted reuse, not by past use. A block evicted before its first reuse (the previous
turn of a conversation whose next turn has not come yet) is exactly the block a chat needs next, so
a rule that waits for a second use drops it. The ``predicted`` rule instead estimates, per class of
block, the chance that a victim is requested again, learned online from a ghost list: every
decision is remembered (bounded); a later request for the key counts a return for its class, a key
that falls off the ghost list counts a miss. A class is

- the block's past uses (1, 2, 3 or more),
- whether it is the tail of a finished request (``request_finished``) that no later request has
  extended yet, and whether that tail is still live (finished or requested within ``tail_ttl_s``),
- the length of the chain it was last requested in (log2 buckets).

A victim is written when its expected saving beats the write: ``p * recompute_s >= write_s``. Write
bandwidth is a budget, not a filter: while the writer has spare bandwidth (``spare``, from the caller)
every victim goes; under pressure the least valuable are skipped first. Pinned and shared blocks
are always written.

Plain code, no threads and no I/O: the daemon and ``tierkv replay`` both call it. Keys are any
hashable (the simulator's pages, the daemon's fingerprinted keys).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

from tierkv.policy.base import Setting, checked_settings
from tierkv.policy.history import History

MODES = ("predicted", "reused", "all", "pinned")


class _Chain:
    """The last request a block was seen in: its length, when it was used, whether it finished."""

    __slots__ = ("length", "t", "finished", "tail")

    def __init__(self, length: int, t: float) -> None:
        self.length, self.t, self.finished, self.tail = length, t, False, None


class Placement:
    """The admission rule of one cold tier (see the module docstring).

    Args:
        mode: ``predicted`` (the default), ``reused`` (used twice, shared or pinned), ``all``, or
            ``pinned`` (pinned only).
        history: use counts shared with the policies; a private one is made if ``None``.
        **settings: see ``SETTINGS``.
    """

    SETTINGS = {
        "tail_ttl_s": Setting(600.0, "a finished or requested chain counts as live this long", min=0.0),
        "ghost_entries": Setting(1 << 16, "decisions remembered to learn which classes come back", min=16),
        "prior": Setting(0.5, "return probability assumed for a class not seen yet", min=0.0, max=1.0),
        "recompute_s": Setting(0.05, "seconds to recompute one block at the start of a prompt", min=0.0),
        "depth_cost": Setting(0.02, "extra recompute cost per block of depth (fraction of recompute_s)",
                              min=0.0),
        "write_s": Setting(0.02, "seconds of writer time one block costs", min=0.0),
    }

    def __init__(self, mode: str = "predicted", history: History | None = None, **settings: Any) -> None:
        if mode not in MODES:
            raise ValueError(f"admission mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.history = history if history is not None else History()
        self._settings = {k: s.default for k, s in self.SETTINGS.items()}
        self.update(**settings)
        self._chain: OrderedDict[Hashable, _Chain] = OrderedDict()
        self._depth: dict[Hashable, int] = {}
        self._ghost: OrderedDict[Hashable, int] = OrderedDict()
        self._back: dict[int, float] = {}
        self._gone: dict[int, float] = {}
        self.admitted = 0
        self.rejected = 0
        self.returns = 0
        self.finished = 0

    # -- engine signals -----------------------------------------------------------------------
    def requested(self, keys: Sequence[Hashable], now: float, hits: int = 0) -> None:
        """A request looked up ``keys`` (its prefix chain, in order): one use each; ghosts return."""
        chain = _Chain(len(keys), now)
        chain.tail = keys[-1] if keys else None
        for depth, key in enumerate(keys):
            self.history.use(key, now, 0.0)
            old = self._chain.get(key)
            if old is not None and old.tail is key:
                old.tail = None  # a finished request's tail, extended by this one
            self._chain[key] = chain
            self._chain.move_to_end(key)
            self._depth[key] = depth
            cls = self._ghost.pop(key, None)
            if cls is not None:
                self._back[cls] = self._back.get(cls, 0.0) + 1.0
                self.returns += 1
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
        chain.finished, chain.t, chain.tail = True, now, keys[-1]

    def stored(self, keys: Sequence[Hashable], now: float) -> None:
        """``keys`` (a chain, in order) were stored: a use for those no request has announced; a key
        on the ghost list counts a return (it was dropped and computed again)."""
        ghost, back = self._ghost, self._back
        fresh = [k for k in keys if k not in self._chain]
        for key in keys:
            cls = ghost.pop(key, None)
            if cls is not None:
                back[cls] = back.get(cls, 0.0) + 1.0
                self.returns += 1
        if fresh:
            self.requested(fresh, now)

    def _trim(self) -> None:
        cap = 2 * self._settings["ghost_entries"]
        while len(self._chain) > cap:
            key, _ = self._chain.popitem(last=False)
            self._depth.pop(key, None)

    # -- the decision ---------------------------------------------------------------------------
    def block_class(self, key: Hashable, now: float) -> int:
        """The class a block is learned in (see the module docstring)."""
        uses = min(self.history.seen(key), 3)
        chain = self._chain.get(key)
        if chain is None:
            return uses * 64
        live = now - chain.t <= self._settings["tail_ttl_s"]
        tail = chain.tail is key or chain.tail == key
        return uses * 64 + (tail * 2 + live) * 8 + min(chain.length.bit_length(), 7)

    def reuse_p(self, cls: int) -> float:
        """The learned chance that a block of class ``cls`` is requested again."""
        back, gone = self._back.get(cls, 0.0), self._gone.get(cls, 0.0)
        return (back + 2.0 * self._settings["prior"]) / (back + gone + 2.0)

    def wants(self, key: Hashable, now: float, *, sharers: int = 0, pinned: bool = False,
              spare: bool = False) -> bool:
        """Whether a victim ``key`` would be written (no side effects; see :meth:`admit`)."""
        mode = self.mode
        if mode == "all" or pinned:
            return True
        if mode == "pinned":
            return False
        if mode == "reused":
            return sharers >= 2 or self.history.seen(key) >= 2
        if spare or sharers >= 2:
            return True
        s = self._settings
        saved = s["recompute_s"] * (1.0 + s["depth_cost"] * self._depth.get(key, 0))
        return self.reuse_p(self.block_class(key, now)) * saved >= s["write_s"]

    def admit(self, key: Hashable, now: float, *, sharers: int = 0, pinned: bool = False,
              spare: bool = False) -> bool:
        """Whether a victim ``key`` is written to the tier; counts and remembers the decision.

        Args:
            key: the block leaving the faster tier.
            now: the caller's clock (seconds).
            sharers: live leases plus prefix children.
            pinned: the block belongs to a pinned prefix.
            spare: the writer has spare bandwidth (its queue is empty): every victim goes.
        """
        ok = self.wants(key, now, sharers=sharers, pinned=pinned, spare=spare)
        if self.mode == "predicted":
            self._remember(key, self.block_class(key, now))
        if ok:
            self.admitted += 1
        else:
            self.rejected += 1
        return ok

    def _remember(self, key: Hashable, cls: int) -> None:
        self._ghost[key] = cls
        self._ghost.move_to_end(key)
        if len(self._ghost) > self._settings["ghost_entries"]:
            _, old = self._ghost.popitem(last=False)
            self._gone[old] = self._gone.get(old, 0.0) + 1.0


    def snapshot(self) -> dict[str, Any]:
        """Counters and the learned classes (for ``tierkv stats``)."""
        classes = {str(c): round(self.reuse_p(c), 3) for c in sorted(set(self._back) | set(self._gone))}
        return {"mode": self.mode, "admitted": self.admitted, "rejected": self.rejected,
                "returns": self.returns, "finished_requests": self.finished, "ghost": len(self._ghost),
                "classes": classes}

    # -- settings -----------------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """The effective settings (a copy), with the mode."""
        return {"mode": self.mode, **self._settings}

    def update(self, **settings: Any) -> None:
        """Change settings; a bad key or value raises ``ValueError`` and changes nothing."""
        mode = settings.pop("mode", self.mode)
        if mode not in MODES:
            raise ValueError(f"admission mode must be one of {', '.join(MODES)}, got {mode!r}")
        self._settings = checked_settings(self.SETTINGS, self._settings, settings, "admission")
        self.mode = mode

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
- the length of that chain (log2 buckets),
- how many tokens the request that chain came from generated (``output_edges`` buckets; 0 while it
  is unknown: the request has not finished, or the engine did not say). The engine knows it once a
  request finishes (``request_finished(..., output_tokens=n)``), before its blocks leave host memory.

Plain code, no threads and no I/O. Keys are any hashable (the simulator's pages, the daemon's
fingerprinted keys). The admission rule (:mod:`tierkv.cache.admission`) and, through ``reuse``,
the attention policy use it.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

from tierkv.cache.knobs import Setting, Values, checked_settings

COUNTS_VERSION = 1  # the class encoding below; counts of another encoding are not loaded
COUNTS_KEPT = 10_000.0
_MAX_CLASS = 4096


def _class_counts(obj: object) -> dict[int, float] | None:
    """``{class: count}`` from loaded data, or None if it is not that."""
    if not isinstance(obj, dict) or len(obj) > _MAX_CLASS:
        return None
    out: dict[int, float] = {}
    for cls, n in obj.items():
        if isinstance(cls, bool) or not isinstance(cls, int) or not 0 <= cls < _MAX_CLASS:
            return None
        if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n) or n < 0:
            return None
        out[cls] = float(n)
    return out


class _Chain:
    """The last request a block was seen in: its length, its tail, when it was last used, and the
    bucket of the tokens it generated (0 until it finishes with a count)."""

    __slots__ = ("length", "t", "tail", "out")

    def __init__(self, length: int, t: float, tail: Hashable | None) -> None:
        self.length, self.t, self.tail, self.out = length, t, tail, 0


def parse_edges(text: str) -> tuple[int, ...]:
    """``"32,128"`` -> ``(32, 128)``: increasing token counts > 0; ``""`` -> ``()``. Bad text raises
    ``ValueError``."""
    try:
        edges = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"output_edges: expected comma-separated token counts, got {text!r}") from None
    if any(e <= 0 for e in edges) or list(edges) != sorted(set(edges)):
        raise ValueError(f"output_edges: token counts must be > 0 and increasing, got {text!r}")
    if len(edges) > 6:
        raise ValueError(f"output_edges: at most 6 edges, got {len(edges)}")
    return edges


class _Rec:
    """One block: the chain it was last seen in, its depth there, how often it was used."""

    __slots__ = ("chain", "depth", "uses")

    def __init__(self, chain: _Chain, depth: int) -> None:
        self.chain, self.depth, self.uses = chain, depth, 0


class ReuseModel:
    """Learns per block class how often blocks that left a tier come back (module docstring).

    Args:
        **settings: see ``SETTINGS``.
    """

    SETTINGS = {
        "tail_ttl_s": Setting(600.0, "a requested or finished chain counts as live this long", min=0.0),
        "ghost_entries": Setting(1 << 16, "departures remembered to learn which classes come back", min=16),
        "prior": Setting(0.5, "return probability assumed for a class not seen yet", min=0.0, max=1.0),
        "max_records": Setting(1 << 17, "blocks remembered (uses, chain), least recently used dropped first",
                               min=16),
        "output_edges": Setting("32,128", "generated-token counts that split finished requests into "
                                "classes (comma-separated; empty: not a class)"),
    }

    def __init__(self, **settings: object) -> None:
        self._settings = Values({k: s.default for k, s in self.SETTINGS.items()})
        self.update(**settings)
        self._rec: OrderedDict[Hashable, _Rec] = OrderedDict()
        self._ghost: OrderedDict[Hashable, int] = OrderedDict()
        self._back: dict[int, float] = {}
        self._gone: dict[int, float] = {}
        self.returns = 0
        self.restored = False
        self.finished = 0
        self.finished_with_output = 0

    # -- signals --------------------------------------------------------------------------------
    def requested(self, keys: Sequence[Hashable], now: float) -> None:
        """A request named ``keys`` (its prefix chain, in order): one use each; ghosts return."""
        if not keys:
            return
        chain = _Chain(len(keys), now, keys[-1])
        recs = self._rec
        for d, key in enumerate(keys):
            r = recs.get(key)
            if r is None:
                r = recs[key] = _Rec(chain, d)
            else:
                old = r.chain
                if old is not chain and old.tail == key:
                    old.tail = None  # the chain it ended is extended by this request
                r.chain, r.depth = chain, d
                recs.move_to_end(key)
            r.uses += 1
        self.returned(keys)
        self._trim()

    def request_finished(self, keys: Sequence[Hashable], now: float, output_tokens: int | None = None) -> None:
        """``keys`` (a chain, in order) finished a request: a conversation tail that may be extended.
        ``output_tokens``: how many tokens the request generated, if the engine says."""
        if not keys:
            return
        self.finished += 1
        r = self._rec.get(keys[-1])
        if r is None:
            self.requested(keys, now)
            r = self._rec[keys[-1]]
        r.chain.t, r.chain.tail = now, keys[-1]
        if output_tokens is not None:
            self.finished_with_output += 1
            if self._edges:
                r.chain.out = 1 + bisect.bisect_right(self._edges, output_tokens)

    def stored(self, keys: Sequence[Hashable], now: float, parent: Hashable | None = None) -> None:
        """``keys`` (a chain, in order, continuing ``parent``) were stored: a use for those no request
        named; a key on the ghost list counts a return (it was dropped and computed again). New keys
        after the tail of the chain a request just named extend that chain, as if the request had named
        them too (an engine asks for its cached prefix, then stores the rest)."""
        fresh = [k for k in keys if k not in self._rec]
        self.returned(keys)
        head = self._rec.get(parent) if parent is not None else None
        if head is None or head.chain.tail != parent or len(fresh) != len(keys):
            if fresh:
                self.requested(fresh, now)
            return
        chain = head.chain
        chain.length, chain.t, chain.tail = chain.length + len(keys), now, keys[-1]
        for d, key in enumerate(keys, head.depth + 1):
            r = self._rec[key] = _Rec(chain, d)
            r.uses = 1
        self._trim()

    def left(self, key: Hashable, now: float, horizon: int | None = None) -> None:
        """``key`` left the tier (evicted, demoted or dropped): remember its class. ``horizon``: how
        many departures to remember (the blocks the tier holds now), instead of ``ghost_entries``."""
        ghost = self._ghost
        ghost[key] = self.block_class(key, now)
        ghost.move_to_end(key)
        limit = self._settings.number("ghost_entries") if horizon is None else max(16, horizon)
        while len(ghost) > limit:
            _, old = ghost.popitem(last=False)
            self._gone[old] = self._gone.get(old, 0.0) + 1.0

    def returned(self, keys: Sequence[Hashable]) -> None:
        """Keys on the ghost list among ``keys`` count a return for the class they left in (part of
        :meth:`requested` and :meth:`stored`; all a :meth:`sibling` is told of them)."""
        ghost, back = self._ghost, self._back
        for key in keys:
            cls = ghost.pop(key, None)
            if cls is not None:
                back[cls] = back.get(cls, 0.0) + 1.0
                self.returns += 1

    def sibling(self, ghost_entries: int) -> ReuseModel:
        """A model over this one's block records (uses, chains: kept by this model alone) with a ghost
        list of its own, ``ghost_entries`` long, and counts of its own. Tell it departures with
        :meth:`left` and requests and stores with :meth:`returned` only."""
        twin = ReuseModel(**{**self._settings, "ghost_entries": ghost_entries})
        twin._rec = self._rec
        return twin

    def _trim(self) -> None:
        recs, cap = self._rec, self._settings.number("max_records")
        while len(recs) > cap:
            recs.popitem(last=False)

    # -- estimates ------------------------------------------------------------------------------
    def block_class(self, key: Hashable, now: float) -> int:
        """The class a block is learned in (see the module docstring)."""
        r = self._rec.get(key)
        if r is None:
            return 0
        uses, chain = min(r.uses, 3), r.chain
        live = now - chain.t <= self._settings.number("tail_ttl_s")
        tail = chain.tail == key
        return chain.out * 256 + uses * 64 + (tail * 2 + live) * 8 + min(chain.length.bit_length(), 7)

    def uses(self, key: Hashable) -> int:
        """How many requests and stores used ``key`` (0 if it is not remembered)."""
        r = self._rec.get(key)
        return r.uses if r is not None else 0

    def depth(self, key: Hashable) -> int:
        """The block's position in the chain it was last seen in (0 if it is not remembered)."""
        r = self._rec.get(key)
        return r.depth if r is not None else 0

    def class_p(self, cls: int) -> float:
        """The learned chance that a block of class ``cls`` comes back."""
        back, gone = self._back.get(cls, 0.0), self._gone.get(cls, 0.0)
        return (back + 2.0 * self._settings.number("prior")) / (back + gone + 2.0)

    def is_tail(self, key: Hashable) -> bool:
        """Whether ``key`` is the tail of the chain it was last seen in (no later request extended it)."""
        r = self._rec.get(key)
        return r is not None and r.chain.tail == key

    def p(self, key: Hashable, now: float) -> float:
        """The learned chance that ``key`` comes back once it leaves the tier."""
        return self.class_p(self.block_class(key, now))

    def predictor(self, clock: Callable[[], float]) -> Callable[[Hashable], float]:
        """``key -> p(key, clock())``: what a policy's ``reuse`` hook takes."""
        return lambda key: self.p(key, clock())

    def snapshot(self) -> dict[str, object]:
        """Counters and the learned classes."""
        classes = {str(c): round(self.class_p(c), 3) for c in sorted(set(self._back) | set(self._gone))}
        return {"returns": self.returns, "finished_requests": self.finished,
                "finished_with_output_tokens": self.finished_with_output, "ghost": len(self._ghost),
                "restored_counts": self.restored, "classes": classes}

    # -- the learned counts across restarts -----------------------------------------------------
    def counts(self) -> dict[str, object]:
        """The learned class counts, for :meth:`load_counts` in a later run (plain msgpack-able data)."""
        return {"version": COUNTS_VERSION, "output_edges": self._settings.text("output_edges"),
                "back": dict(self._back), "gone": dict(self._gone)}

    def load_counts(self, data: object, keep: float = COUNTS_KEPT) -> bool:
        """Start from the counts :meth:`counts` gave in an earlier run, each class scaled to at most
        ``keep`` departures so that this run's own ones soon weigh as much. Returns False, changing
        nothing, when they do not fit: another format or other ``output_edges``, or malformed."""
        if not isinstance(data, dict) or data.get("version") != COUNTS_VERSION \
                or data.get("output_edges") != self._settings.text("output_edges"):
            return False
        back, gone = _class_counts(data.get("back")), _class_counts(data.get("gone"))
        if back is None or gone is None:
            return False
        for cls in set(back) | set(gone):
            total = back.get(cls, 0.0) + gone.get(cls, 0.0)
            if total > keep:
                scale = keep / total
                back[cls] = back.get(cls, 0.0) * scale
                gone[cls] = gone.get(cls, 0.0) * scale
        self._back, self._gone, self.restored = back, gone, True
        return True

    # -- settings -------------------------------------------------------------------------------
    def settings(self) -> Values:
        """The effective settings (a copy)."""
        return Values(self._settings)

    def update(self, **settings: object) -> None:
        """Change settings; a bad key or value raises ``ValueError`` and changes nothing."""
        new = checked_settings(self.SETTINGS, self._settings, settings, "reuse model")
        self._edges = parse_edges(new.text("output_edges"))
        self._settings = new

"""Admission to a colder tier: which blocks leaving a faster tier are written there.

Admission by predicted reuse, not by past use. A block evicted before its first reuse (the previous
turn of a conversation whose next turn has not come yet) is exactly the block a chat needs next, so
a rule that waits for a second use drops it. The ``predicted`` rule asks a
:class:`~tierkv.cache.reuse.model.ReuseModel` (a ghost list per block class) for the chance ``p`` that a
victim is requested again, and writes it when the expected saving beats the write::

    p * recompute_s * (1 + depth_cost * depth) >= write_s

Write bandwidth is a budget: while the writer has spare bandwidth (``spare``, from the caller) every
victim goes but the tails under the floor (below); under pressure the least valuable are skipped
first. Pinned and shared blocks are always written. The other modes: ``reused`` (a block used again
since it was cached, a leased or a pinned one: :func:`reused`), ``all``, ``pinned``. The daemon's
remote tier asks the same rule with its own mode (``remote.admission``).

The floor: a chain's tail (the last block of the request it was last seen in, which no later
request has extended) comes back only when a later request holds it whole: the next turn of a
conversation does when the tail is a full block and never when it is a partial one. A third model
(``floor_model``) learns on a ghost list ``floor_horizon`` (0.25) times as long as the admission
model's, so it counts a tail that never returns as a miss after a quarter of the departures the
admission model waits (on a short trace, that model's list may never turn over). A tail whose class
returns less often than ``floor`` (0.05) within that shorter list is not written, writer idle or
busy. Other blocks are left to the admission model: a class that returns late (after the shorter
list) would look dead to the floor (docs/eviction-admission.md).

The colder tier's eviction order weighs its blocks by a second model (``evict_model``, a
:meth:`~tierkv.cache.reuse.model.ReuseModel.sibling` over the same block records), whose ghost list
is ``evict_horizon`` (0.75) times as long: the order wants the chance of a
return while the tier would still hold the block, the admission rule a more generous one (on the
synthetic trace the shorter list gains the eviction order 0.4-0.5 points and costs the admission
rule 3.5: docs/eviction-admission.md).

With ``shadow_rate`` > 0 the ``predicted`` rule never trails writing every victim for long: an
:class:`~tierkv.cache.admission_shadow.AdmissionShadow` feeds the victims of a hash sample of
the branches (``unit``, set by the owner: the branch of a key; the key itself by default) to two
small LRU caches, one taking the rule's writes and one every victim, and while write-all hits
clearly more there every victim is written (as ``all``).

Plain code, no threads and no I/O: the daemon and ``tierkv replay`` both call it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from tierkv.cache.admission_shadow import AdmissionShadow
from tierkv.cache.knobs import Setting, Values, checked_settings
from tierkv.cache.reuse import ReuseModel

MODES = ("predicted", "reused", "all", "pinned")


def _same(key: Hashable) -> Hashable:
    return key


def _check_mode(mode: object) -> str:
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"admission mode must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def reused(hits: int, sharers: int, pinned: bool) -> bool:
    """The ``reused`` rule: the block was used again since it was cached (``hits``: leases and stores
    that found it cached), is leased now (``sharers``) or belongs to a pinned prefix."""
    return pinned or hits >= 1 or sharers >= 1


class Admission:
    """The admission rule of one cold tier (see the module docstring).

    Args:
        mode: ``predicted`` (the default), ``reused``, ``all`` or ``pinned``.
        **settings: see ``SETTINGS`` and :attr:`ReuseModel.SETTINGS`.
    """

    SETTINGS = {
        "recompute_s": Setting(0.05, "seconds to recompute one block at the start of a prompt", min=0.0),
        "depth_cost": Setting(0.02, "extra recompute cost per block of depth (fraction of recompute_s)",
                              min=0.0),
        "write_s": Setting(0.02, "seconds of writer time one block costs", min=0.0),
        "evict_horizon": Setting(0.75, "ghost list of the model the tier's eviction order weighs blocks "
                                 "by, as a multiple of ghost_entries", min=0.01, max=16.0),
        "floor": Setting(0.05, "a chain tail whose chance of a return within floor_horizon is below this "
                         "is not written (0 = off)", min=0.0, max=1.0),
        "floor_horizon": Setting(0.25, "ghost list of the model the floor reads, as a multiple of "
                                 "ghost_entries", min=0.01, max=16.0),
        "shadow_rate": Setting(0.0, "fraction of branches (by hash) on which the rule's writes and writing "
                               "every victim are simulated side by side; every victim is written while "
                               "write-all hits more there (0 = off)", min=0.0, max=1.0),
        "shadow_window": Setting(20000.0, "requests with sampled returns over which the shadow counts wins",
                                 min=16.0),
        "shadow_z": Setting(3.0, "standard deviations by which write-all's lead in the shadow must pass a "
                            "coin's to take over", min=0.0, max=10.0),
    }

    def __init__(self, mode: str = "predicted", **settings: object) -> None:
        self.mode = _check_mode(mode)
        own = {k: v for k, v in settings.items() if k not in ReuseModel.SETTINGS}
        self.model = ReuseModel(**{k: v for k, v in settings.items() if k in ReuseModel.SETTINGS})
        self._settings = checked_settings(self.SETTINGS, {k: s.default for k, s in self.SETTINGS.items()},
                                          own, "admission")
        self.evict_model = self.model.sibling(self._evict_ghost())
        self.floor_model = self.model.sibling(self._floor_ghost())
        self.admitted = 0
        self.rejected = 0
        self.unit: Callable[[Hashable], Hashable] = _same  # a key's sampling unit (its branch)
        self.shadow: AdmissionShadow | None = None
        self._shadow_key: tuple[float, float, float] | None = None
        self._make_shadow()

    def _make_shadow(self) -> None:
        """(Re)build the shadow when its settings changed; it starts empty."""
        s = self._settings
        key = (s.number("shadow_rate"), s.number("shadow_window"), s.number("shadow_z"))
        if key != self._shadow_key:
            self._shadow_key = key
            self.shadow = AdmissionShadow(*key) if key[0] else None

    @property
    def writes_all(self) -> bool:
        """Whether every victim is written now (``predicted``, and the shadow finds write-all ahead)."""
        return self.mode == "predicted" and self.shadow is not None and self.shadow.leader == 1

    def resize(self, nbytes: int) -> None:
        """The tier holds ``nbytes`` when full (the shadow's small caches are sized from it)."""
        if self.shadow is not None:
            self.shadow.resize(nbytes)

    def departed(self, key: Hashable, size: int, held: bool) -> None:
        """A victim not offered to :meth:`admit` left the faster tier (``held``: the tier has a copy;
        else it was not worth writing), for the shadow."""
        shadow = self.shadow
        if shadow is not None and self.mode == "predicted" and shadow.sampled(self.unit(key)):
            shadow.departed(key, size, None if held else False)

    # -- engine signals, passed to the models -----------------------------------------------------
    def requested(self, keys: Sequence[Hashable], now: float) -> None:
        """A request named ``keys`` (its prefix chain, in order); see :meth:`ReuseModel.requested`."""
        self.model.requested(keys, now)
        self.evict_model.returned(keys)
        self.floor_model.returned(keys)
        if self.shadow is not None:
            self.shadow.requested(keys)

    def request_finished(self, keys: Sequence[Hashable], now: float, output_tokens: int | None = None) -> None:
        """A request finished; ``keys`` are a conversation tail that may be extended."""
        self.model.request_finished(keys, now, output_tokens)

    def stored(self, keys: Sequence[Hashable], now: float, parent: Hashable | None = None) -> None:
        """``keys`` (a chain continuing ``parent``) were stored; see :meth:`ReuseModel.stored`."""
        self.model.stored(keys, now, parent)
        self.evict_model.returned(keys)
        self.floor_model.returned(keys)

    # -- the decision -----------------------------------------------------------------------------
    def wants(self, key: Hashable, now: float, *, hits: int = 0, sharers: int = 0, pinned: bool = False,
              spare: bool = False, mode: str | None = None) -> bool:
        """Whether a victim ``key`` would be written (no side effects; see :meth:`admit`). ``mode``:
        another tier's mode (the remote tier's ``reused``, ``all`` or ``pinned``) instead of the rule's."""
        mode = self.mode if mode is None else _check_mode(mode)
        return self._rule(mode, key, now, hits, sharers, pinned, spare) or (mode == "predicted" and self.writes_all)

    def _rule(self, mode: str, key: Hashable, now: float, hits: int, sharers: int, pinned: bool,
              spare: bool) -> bool:
        if mode == "all" or pinned:
            return True
        if mode == "pinned":
            return False
        if mode == "reused":
            return reused(hits, sharers, pinned)
        if sharers >= 2:
            return True
        s = self._settings
        if s.number("floor") and self.model.is_tail(key) and self.floor_model.p(key, now) < s.number("floor"):
            return False
        if spare:
            return True
        saved = s.number("recompute_s") * (1.0 + s.number("depth_cost") * self.model.depth(key))
        return self.model.p(key, now) * saved >= s.number("write_s")

    def admit(self, key: Hashable, now: float, *, hits: int = 0, sharers: int = 0, pinned: bool = False,
              spare: bool = False, size: int = 1) -> bool:
        """Whether a victim ``key`` is written to the tier; counts the decision and, in ``predicted``
        mode, remembers it on the model's ghost list.

        Args:
            key: the block leaving the faster tier.
            now: the caller's clock (seconds).
            hits: uses of the block since it was cached (``reused``).
            sharers: live leases on the block.
            pinned: the block belongs to a pinned prefix.
            spare: the writer has spare bandwidth (its queue is empty): every victim goes but the
                tails under the floor.
            size: the bytes the block takes in the tier (for the shadow).
        """
        ok = self._rule(self.mode, key, now, hits, sharers, pinned, spare)
        if self.mode == "predicted":
            self.model.left(key, now)
            self.evict_model.left(key, now)
            self.floor_model.left(key, now)
            shadow = self.shadow
            if shadow is not None and shadow.sampled(self.unit(key)):
                shadow.departed(key, size, ok)
            ok = ok or self.writes_all
        if ok:
            self.admitted += 1
        else:
            self.rejected += 1
        return ok

    def snapshot(self) -> dict[str, object]:
        """Counters and the learned classes (for ``tierkv stats``)."""
        return {"mode": self.mode, "admitted": self.admitted, "rejected": self.rejected,
                **self.model.snapshot(), "eviction": self._brief(self.evict_model),
                "floor": self._brief(self.floor_model),
                **({"shadow": self.shadow.snapshot()} if self.shadow is not None else {})}

    @staticmethod
    def _brief(model: ReuseModel) -> dict[str, object]:
        return {k: v for k, v in model.snapshot().items() if k in ("returns", "ghost", "restored_counts", "classes")}

    # -- settings ---------------------------------------------------------------------------------
    def settings(self) -> Values:
        """The effective settings (a copy), with the mode and the model's."""
        return Values({"mode": self.mode, **self._settings, **self.model.settings()})

    def update(self, **settings: object) -> None:
        """Change settings; a bad key or value raises ``ValueError`` and changes nothing."""
        mode = _check_mode(settings.pop("mode", self.mode))
        model = {k: settings.pop(k) for k in list(settings) if k in ReuseModel.SETTINGS}
        own = checked_settings(self.SETTINGS, self._settings, settings, "admission")
        self.model.update(**model)
        self._settings, self.mode = own, mode
        self._make_shadow()
        self.evict_model.update(**{**self.model.settings(), "ghost_entries": self._evict_ghost()})
        self.floor_model.update(**{**self.model.settings(), "ghost_entries": self._floor_ghost()})

    def _evict_ghost(self) -> int:
        """The eviction model's ghost list: ``evict_horizon`` times the admission model's."""
        return max(16, round(self._settings.number("evict_horizon") * self.model.settings().count("ghost_entries")))

    def _floor_ghost(self) -> int:
        """The floor model's ghost list: ``floor_horizon`` times the admission model's."""
        return max(16, round(self._settings.number("floor_horizon") * self.model.settings().count("ghost_entries")))

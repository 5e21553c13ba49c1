"""The eviction-policy interface, its settings, and the registry.

A policy only picks victims; capacity and watermarks live in the tier. One instance serves one
tier. The primitives:

- ``on_insert(key, size, parent)``: a block entered this tier (not a use by itself: when the block
  enters because it is being used, a commit or a promotion for a read, call ``on_access`` too).
- ``on_access(key)``: a hit or use of the block in this tier.
- ``on_remove(key)``: the block left this tier (evicted, demoted, promoted, dropped).
- ``victims(nbytes, protected)``: blocks whose recorded sizes sum to at least ``nbytes``, none of them
  protected; all or nothing (``None`` when impossible). It never changes membership: the caller calls
  ``on_remove`` for each block it really moves.

Optional hooks with no-op defaults: ``on_touch`` (attention mass), ``on_sharers`` (leases + children).
Every policy has named, typed settings that can be changed at run time with ``update``.
"""

from __future__ import annotations

import heapq
import importlib
import itertools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import ClassVar, Generic, TypeVar

from tierkv.cache.knobs import Setting, Values, checked_settings
from tierkv.cache.policy.shadow import Shadow

Clock = Callable[[], float]
Protected = Callable[[Hashable], bool]
K = TypeVar("K", bound=Hashable)


def never(_key: Hashable) -> bool:
    """A ``protected`` predicate that protects nothing."""
    return False


def walk_victims(segments: Iterable[Iterable[tuple[Hashable, int]]], nbytes: int,
                 protected: Protected) -> list[Hashable] | None:
    """Take unprotected (key, size) pairs in order until ``nbytes`` are covered; None if they never are."""
    if nbytes <= 0:
        return []
    out, got = [], 0
    for segment in segments:
        for key, size in segment:
            if protected(key):
                continue
            out.append(key)
            got += size
            if got >= nbytes:
                return out
    return None


class Policy(ABC, Generic[K]):
    """Chooses which blocks leave one tier. See the module docstring for the contract. ``K``: the type of
    the keys its tier gives it."""

    name: ClassVar[str] = ""
    oracle: ClassVar[bool] = False  # needs the future (the simulator's next uses): replay only
    HOOKS: ClassVar[frozenset[str]] = frozenset()  # what it takes besides settings (cost_fn, history, ...)
    SETTINGS: ClassVar[dict[str, Setting]] = {}
    # What the store reads of every policy; the attention family sets them, the others keep these.
    shadow: Shadow | None = None  # the recency shadow that may take the order over (None: none)
    shadow_on_requests: bool = False  # a colder tier's shadow is fed by its references, not by uses
    tau: float = 0.0  # idle aging's half-life in seconds (0: off)
    reuse: Callable[[Hashable], float] | None = None  # the reuse model that weighs blocks (None: none)

    def __init__(self, *, clock: Clock = time.monotonic, **settings: object) -> None:
        self.clock = clock
        self._settings = Values({k: s.default for k, s in self.SETTINGS.items()})
        self.update(**settings)

    # -- membership ---------------------------------------------------------------------------
    @abstractmethod
    def on_insert(self, key: K, size: int, parent: K | None = None) -> None:
        """Record that ``key`` (``size`` bytes in this tier, child of ``parent``) entered the tier."""

    @abstractmethod
    def on_access(self, key: K) -> None:
        """Record a hit or use of a resident block."""

    @abstractmethod
    def on_remove(self, key: K) -> None:
        """Forget a block that left the tier; unknown keys are ignored."""

    @abstractmethod
    def victims(self, nbytes: int, protected: Callable[[K], bool] = never) -> list[K] | None:
        """Pick blocks to free at least ``nbytes``.

        Args:
            nbytes: bytes to free; ``<= 0`` returns ``[]``.
            protected: ``protected(key)`` is true for blocks that must stay (leased, pinned).

        Returns:
            Keys whose recorded sizes sum to ``>= nbytes``, best victim first, or ``None`` if the
            unprotected blocks are not enough. Membership is unchanged.
        """

    def victims_past_busy(self, nbytes: int, protected: Callable[[K], bool] = never) -> list[K] | None:
        """Like :meth:`victims`, for a store that cannot wait: when the usual order finds too little, a
        block that must stay does not hold back the blocks ordered after it (a chain whose tail is
        being written gives up its parents). Same return as :meth:`victims`."""
        return self.victims(nbytes, protected)

    def has_children(self, key: K) -> bool:
        """Whether the tier holds a block whose chain parent is ``key`` (``key`` held here or not): the
        prefix of a block this tier holds. False for a policy that keeps no chains."""
        return False

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    # -- optional signals ---------------------------------------------------------------------
    def referenced(self, key: K, parent: K | None = None) -> None:  # noqa: B027 - optional hook
        """A request used ``key`` and the tier above this one did not hold it: a reference at this
        tier's level, whether this tier holds ``key`` or not (a lower tier's reference stream)."""

    def on_touch(self, key: K, mass: float) -> None:  # noqa: B027 - optional hook
        """Attention mass reported by a client for a resident block (1.0 = uniform)."""

    def on_sharers(self, key: K, sharers: int) -> None:  # noqa: B027 - optional hook
        """Live leases plus prefix children of a block changed to ``sharers``."""

    # -- settings -----------------------------------------------------------------------------
    def settings(self) -> Values:
        """The effective settings (a copy)."""
        return Values(self._settings)

    def update(self, **settings: object) -> None:
        """Change settings at run time; a bad key or value raises ``ValueError`` and changes nothing."""
        self._settings = checked_settings(self.SETTINGS, self._settings, settings, f"policy {self.name!r}")
        self._settings_changed()

    def _settings_changed(self) -> None:  # noqa: B027 - optional hook
        """Called after settings change (e.g. to cache values in attributes)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} blocks={len(self)}>"


class HeapPolicy(Policy):
    """A policy that evicts the lowest priority first, kept in a heap with lazy invalidation.

    Subclasses compute priorities and call :meth:`_set_priority`. Ties go to the older entry.
    With ``tails_first`` a block is only a candidate once none of its children is resident in this
    tier, so prefix chains shrink from the tail (a parent is worth at least its children).
    :meth:`victims_past_busy` lets a child that must stay pass its turn to its parent.
    """

    tails_first = False  # a subclass's setting may change it per instance

    def __init__(self, *, clock: Clock = time.monotonic, **settings: object) -> None:
        self._size: dict[Hashable, int] = {}
        self._prio: dict[Hashable, float] = {}
        self._ver: dict[Hashable, int] = {}
        self._parent: dict[Hashable, Hashable] = {}
        self._kids: dict[Hashable, int] = {}  # resident children per parent key (parent may be absent)
        self._heap: list[tuple[float, int, Hashable]] = []
        self._pending: dict[Hashable, None] = {}  # re-scored since the last victims(): pushed lazily
        self._seq = itertools.count()
        self._last_victims: set[Hashable] = set()
        self.level = 0.0  # GDSF inflation clock: priority of the last block chosen and removed
        super().__init__(clock=clock, **settings)

    # membership bookkeeping shared by subclasses
    def _add(self, key: Hashable, size: int, parent: Hashable | None) -> None:
        if size < 0:
            raise ValueError(f"block size must be >= 0, got {size}")
        self._size[key] = int(size)
        if parent is not None and parent != key:
            self._parent[key] = parent
            self._kids[parent] = self._kids.get(parent, 0) + 1

    def _discard(self, key: Hashable) -> bool:
        if self._size.pop(key, None) is None:
            return False
        self._prio.pop(key, None)
        self._ver.pop(key, None)
        # a tier that never fills (a large disk) never calls victims(), which is what empties _pending
        self._pending.pop(key, None)
        parent = self._parent.pop(key, None)
        if parent is not None:
            left = self._kids[parent] - 1
            if left:
                self._kids[parent] = left
            else:
                del self._kids[parent]
                if self.tails_first and parent in self._prio:  # the parent is a leaf again
                    self._pending[parent] = None
        return True

    def _set_priority(self, key: Hashable, prio: float) -> None:
        self._prio[key] = prio
        self._ver[key] = next(self._seq)
        self._pending[key] = None  # several updates before the next victims() cost one push

    def _flush(self) -> None:
        """Push the entries of blocks re-scored since the last call (leaves only with tails_first)."""
        heap, prio, ver, kids = self._heap, self._prio, self._ver, self._kids
        tails = self.tails_first
        for key in self._pending:
            if key in prio and not (tails and kids.get(key)):
                heapq.heappush(heap, (prio[key], ver[key], key))
        self._pending.clear()
        if len(heap) > 4 * len(self._size) + 1024:
            self._compact()

    def _compact(self) -> None:
        self._heap = [(self._prio[k], self._ver[k], k) for k in self._size
                      if not (self.tails_first and self._kids.get(k))]
        heapq.heapify(self._heap)
        self._pending.clear()

    def on_remove(self, key: Hashable) -> None:
        if key in self._last_victims:  # an eviction we chose: advance the aging clock
            self._last_victims.discard(key)
            self.level = max(self.level, self._prio.get(key, self.level))
        if self._discard(key):
            self._forget(key)

    def _forget(self, key: Hashable) -> None:  # noqa: B027 - optional hook
        """Drop a subclass's per-block state for a block that left the tier."""

    def victims(self, nbytes: int, protected: Protected = never) -> list[Hashable] | None:
        if nbytes <= 0:
            return []
        if self._pending:
            self._flush()
        return self._walk(nbytes, protected, False)

    def victims_past_busy(self, nbytes: int, protected: Protected = never) -> list[Hashable] | None:
        chosen = self.victims(nbytes, protected)
        if chosen is None and self.tails_first and nbytes > 0:
            chosen = self._walk(nbytes, protected, True)
        return chosen

    def _walk(self, nbytes: int, protected: Protected, busy_pass: bool) -> list[Hashable] | None:
        """One victim walk; ``busy_pass``: a protected leaf lets its parent become a candidate."""
        heap, chosen, got = self._heap, [], 0
        popped: list[tuple[float, int, Hashable]] = []  # entries to put back (victims must not mutate)
        chosen_set: set[Hashable] = set()
        taken_kids: dict[Hashable, int] = {}
        while got < nbytes and heap:
            entry = heapq.heappop(heap)
            _, ver, key = entry
            if self._ver.get(key) != ver or key in chosen_set:
                continue  # stale or duplicate
            if self.tails_first and self._kids.get(key, 0) - taken_kids.get(key, 0) > 0:
                continue  # not a leaf; it is pushed again when its last child leaves
            popped.append(entry)
            if protected(key):
                if self.tails_first and busy_pass:
                    self._release_parent(key, heap, taken_kids)
                continue
            chosen.append(key)
            chosen_set.add(key)
            got += self._size[key]
            if self.tails_first:
                self._release_parent(key, heap, taken_kids)
        for entry in popped:
            heapq.heappush(heap, entry)
        if got < nbytes:
            return None
        self._last_victims = chosen_set
        return chosen

    def _release_parent(self, key: Hashable, heap: list[tuple[float, int, Hashable]],
                        taken_kids: dict[Hashable, int]) -> None:
        """``key`` was passed in a victim walk: its parent is a candidate once all its children were."""
        parent = self._parent.get(key)
        if parent is not None and parent in self._size:
            n = taken_kids.get(parent, 0) + 1
            taken_kids[parent] = n
            if n == self._kids[parent]:  # the parent would be a leaf once these go
                heapq.heappush(heap, (self._prio[parent], self._ver[parent], parent))

    def has_children(self, key: Hashable) -> bool:
        return self._kids.get(key, 0) > 0

    def __len__(self) -> int:
        return len(self._size)

    def __contains__(self, key: object) -> bool:
        return key in self._size

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._size)

    def priority(self, key: Hashable) -> float:
        """The current priority of a resident block (higher stays longer)."""
        return self._prio[key]


# -- registry ---------------------------------------------------------------------------------

_REGISTRY: dict[str, type[Policy]] = {}
_MODULES = ("lru", "lfu", "slru", "gdsf", "attention", "adaptive", "belady")


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make ``cls`` available to :func:`make_policy` under ``cls.name``."""
    _REGISTRY[cls.name] = cls
    return cls


def _load_all() -> None:
    for mod in _MODULES:
        importlib.import_module(f"tierkv.cache.policy.{mod}")


def policy_class(name: str) -> type[Policy]:
    """The class registered as ``name``; unknown names raise ``ValueError``."""
    _load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(policy_names(oracles=True))})") from None


def policy_names(*, oracles: bool = False) -> list[str]:
    """Names of the built-in policies; ``oracles`` adds simulator-only ones (``opt``)."""
    _load_all()
    return [n for n, c in _REGISTRY.items() if oracles or not c.oracle]


def make_policy(name: str, *, clock: Clock = time.monotonic, **settings: object) -> Policy:
    """Build the policy registered as ``name`` with ``settings`` (bad ones raise ``ValueError``)."""
    return policy_class(name)(clock=clock, **settings)

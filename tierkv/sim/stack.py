"""The simulated tier stack: which tiers hold each page, and how pages move between them.

Each page is held by a set of tiers (a bit mask, tier 0 fastest). A read served by a lower tier
promotes the page into tier 0; an *inclusive* tier (the daemon's disk: a loaded block keeps its
file copy) keeps its copy and counts a use, an exclusive one gives the page up. Making room in a
tier asks its policy for victims; a victim with a copy further down just leaves, the others are
offered to the next tier through the placement rule (:class:`~tierkv.cache.admission.Admission`)
and dropped when it declines. With quotas (:class:`~tierkv.cache.quotas.Quotas`, the daemon's), a
tenant over its quota in a tier gives up its own pages there first, and the pages of a tenant within
its quota stay against everyone else's, as the daemon's tier managers decide.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tierkv.cache.quotas import TIERS as QUOTA_TIERS
from tierkv.cache.quotas import Quotas


@dataclass
class StackCounters:
    """Bytes and pages counted while replaying."""

    moved: dict[str, int] = field(default_factory=dict)
    dropped_bytes: int = 0
    disk_writes: int = 0

    def move(self, src: str, dst: str, nbytes: int) -> None:
        key = f"{src}->{dst}"
        self.moved[key] = self.moved.get(key, 0) + nbytes


class TierStack:
    """Membership, capacity and movement of pages over the simulated tiers.

    Args:
        names: tier names, fastest first.
        caps: capacity of each tier in bytes.
        sizes: bytes one page takes in each tier (after compression).
        inclusive: per tier, whether a page read from it keeps its copy there.
        policies: one eviction policy per tier.
        page_bytes: raw bytes of a page.
        admit: ``admit(page, tier, now) -> bool``: whether a victim is written into ``tier``.
        parent_of: page -> previous page of its prefix (for prefix-aware policies).
        on_leave: ``on_leave(page, tier)`` for each victim chosen in a tier (before it moves).
        quotas: the tenants' quotas and use (None: no quotas).
        tenant_of: page -> the tenant whose request stored it (pages of no tenant are absent).
    """

    def __init__(self, names: Sequence[str], caps: Sequence[int], sizes: Sequence[int],
                 inclusive: Sequence[bool], policies: Sequence[Any], page_bytes: int,
                 admit: Callable[[int, int], bool], parent_of: dict[int, int],
                 on_leave: Callable[[int, int], None] | None = None, quotas: Quotas | None = None,
                 tenant_of: dict[int, str] | None = None) -> None:
        self.names, self.caps, self.sizes = list(names), list(caps), list(sizes)
        self.inclusive, self.policies = list(inclusive), list(policies)
        self.page_bytes, self.admit, self.parent_of = page_bytes, admit, parent_of
        self.on_leave = on_leave
        self.n = len(self.names)
        self.held: dict[int, int] = {}   # page -> bit mask of the tiers holding it
        self.used = [0] * self.n
        self.c = StackCounters()
        self.quotas = quotas if quotas is not None else Quotas()
        self.tenant_of = tenant_of if tenant_of is not None else {}
        self._quota_tier = [n if n in QUOTA_TIERS else None for n in self.names]

    def fastest(self, page: int) -> int | None:
        """The fastest tier holding ``page`` (None if none)."""
        mask = self.held.get(page)
        return None if not mask else (mask & -mask).bit_length() - 1

    def _add(self, page: int, t: int) -> None:
        self.held[page] = self.held.get(page, 0) | (1 << t)
        self.used[t] += self.sizes[t]
        if self.quotas.on and (qt := self._quota_tier[t]) is not None:
            self.quotas.add(self.tenant_of.get(page), qt, self.sizes[t])
        self.policies[t].on_insert(page, self.sizes[t], self.parent_of.get(page))

    def _remove(self, page: int, t: int) -> None:
        self.policies[t].on_remove(page)
        self.used[t] -= self.sizes[t]
        if self.quotas.on and (qt := self._quota_tier[t]) is not None:
            self.quotas.add(self.tenant_of.get(page), qt, -self.sizes[t])
        mask = self.held[page] & ~(1 << t)
        if mask:
            self.held[page] = mask
        else:
            del self.held[page]

    def use(self, page: int) -> None:
        """A request uses ``page``: a use in every tier holding a copy (the daemon touches the host
        and the disk policy of a block on both)."""
        mask = self.held.get(page, 0)
        for t in range(self.n):
            if mask >> t & 1:
                self.policies[t].on_access(page)

    def promote(self, page: int, t: int) -> None:
        """``page`` is read from tier ``t`` > 0 on its way into tier 0."""
        if self.inclusive[t]:
            self.policies[t].on_access(page)
        else:
            self._remove(page, t)
        self.c.move(self.names[t], self.names[0], self.page_bytes)

    def make_room(self, t: int, nbytes: int, protect: set[int]) -> bool:
        """Free ``nbytes`` in tier ``t`` (victims move further down). False if impossible."""
        qt = self._quota_tier[t] if self.quotas.on else None
        if qt is not None:  # tenants over their quota here give up their own pages first
            for tenant, over in self.quotas.excess(qt).items():
                def other(p: int, tenant: str = tenant) -> bool:
                    return p in protect or self.tenant_of.get(p) != tenant
                own = self.policies[t].victims(over, other)
                if own:
                    self._evict(t, own, protect)
        need = self.used[t] + nbytes - self.caps[t]
        if need <= 0:
            return True
        keep: Callable[[int], bool] = protect.__contains__
        if qt is not None:
            quotas, tenant_of, tier = self.quotas, self.tenant_of, qt

            def shielded(p: int) -> bool:
                return p in protect or quotas.shielded(tenant_of.get(p), tier)
            keep = shielded
        victims = self.policies[t].victims(need, keep)
        if victims is None:
            return False
        self._evict(t, victims, protect)
        return True

    def _evict(self, t: int, victims: list[int], protect: set[int]) -> None:
        below = t + 1
        down: list[int] = []
        for v in victims:
            if self.on_leave is not None:
                self.on_leave(v, t)
            self._remove(v, t)
            if v in self.held and self.held[v] >> below:
                continue  # a copy further down is still there: nothing to write
            if below < self.n and self.admit(v, below):
                down.append(v)
            elif v not in self.held:
                self.c.dropped_bytes += self.page_bytes
        if down:
            self._demote(t, down, protect)

    def _demote(self, t: int, pages: list[int], protect: set[int]) -> None:
        below = t + 1
        size = self.sizes[below]
        if not self.make_room(below, len(pages) * size, protect):
            # the lower tier is full of protected pages: drop what does not fit
            fit = max(0, (self.caps[below] - self.used[below]) // size)
            self.c.dropped_bytes += (len(pages) - fit) * self.page_bytes
            pages = pages[:fit]
            if pages:
                self.make_room(below, len(pages) * size, protect)
        for v in pages:
            self._add(v, below)
        if pages:
            self.c.move(self.names[t], self.names[below], len(pages) * self.page_bytes)
            if self.names[below] == "disk":
                self.c.disk_writes += len(pages) * size

    def insert0(self, pages: list[int], protect: set[int]) -> None:
        """Put ``pages`` (promoted or computed) into tier 0, as many as fit beside ``protect``."""
        if not pages:
            return
        size0 = self.sizes[0]
        pol = self.policies[0]
        if not self.make_room(0, len(pages) * size0, protect):
            fit = 0
            while fit < len(pages) and self.make_room(0, size0, protect):
                self._add(pages[fit], 0)
                pol.on_access(pages[fit])
                fit += 1
            for p in pages[fit:]:
                if p not in self.held:
                    self.c.dropped_bytes += self.page_bytes
            return
        for p in pages:
            self._add(p, 0)
            pol.on_access(p)

"""Per-tenant quotas: the bytes each tenant's blocks may take in a tier, and what they take now.

A tenant is what the engine names a request's owner by (the vLLM connector sends its ``cache_salt``).
A tenant holding no more than its quota in a tier is *shielded* there: no other tenant's stores or
floods evict its blocks (:meth:`Quotas.shielded`); a tenant over its quota gives up its own blocks first
(:meth:`Quotas.excess`). Tenants without a quota, and blocks of no tenant, share what remains as before.
Only tenants with a quota are accounted (a fleet may have a salt per user): a quota's first setting
counts the bytes its tenant holds already. Plain code; the tier managers keep the accounts under the
store's lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Quotas", "TenantUse"]

TIERS = ("host", "disk")


@dataclass
class TenantUse:
    """One tenant's bytes per tier, its quotas (None: none), the blocks fetches served it and the blocks
    its engine computed (offered for storing: not cached)."""

    used: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    quota: dict[str, int | None] = field(default_factory=lambda: dict.fromkeys(TIERS))
    hits: int = 0
    misses: int = 0


class Quotas:
    """Every tenant's use and quota."""

    def __init__(self) -> None:
        self.tenants: dict[str, TenantUse] = {}
        self.on = False  # any quota set: only then do evictions ask

    def set(self, tenant: str, limits: dict[str, int | None], holds: dict[str, int]) -> None:
        """Give ``tenant`` quotas of ``limits`` bytes per tier (None: no quota there; the tiers not named
        keep theirs); ``holds``: the bytes it holds per tier now (read when it had no quota yet). A tenant
        left without any quota is no longer accounted.

        Raises:
            ValueError: an unknown tier, an empty tenant or a negative limit (nothing changes).
        """
        if not tenant:
            raise ValueError("a quota needs a tenant")
        for tier, limit in limits.items():
            if tier not in TIERS:
                raise ValueError(f"a quota is per tier: {', '.join(TIERS)}, not {tier!r}")
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
                raise ValueError(f"a quota is bytes >= 0 or null, got {limit!r}")
        u = self.tenants.get(tenant)
        if u is None:
            u = self.tenants[tenant] = TenantUse(used={t: holds.get(t, 0) for t in TIERS})
        u.quota.update(limits)
        if all(q is None for q in u.quota.values()):
            del self.tenants[tenant]
        self.on = bool(self.tenants)

    def accounted(self, tenant: str) -> bool:
        """Whether ``tenant`` has a quota (and so is accounted)."""
        return tenant in self.tenants

    def add(self, tenant: str | None, tier: str, nbytes: int) -> None:
        """``tenant``'s blocks take ``nbytes`` more (less, when negative) in ``tier``."""
        if tenant is not None and (u := self.tenants.get(tenant)) is not None:
            u.used[tier] += nbytes

    def hit(self, tenant: str | None) -> None:
        """A fetch was served one of ``tenant``'s blocks."""
        if tenant is not None and (u := self.tenants.get(tenant)) is not None:
            u.hits += 1

    def missed(self, tenant: str | None, n: int) -> None:
        """``tenant``'s engine computed ``n`` blocks tierkv did not serve (offered for storing)."""
        if tenant is not None and (u := self.tenants.get(tenant)) is not None:
            u.misses += n

    def shielded(self, tenant: str | None, tier: str) -> bool:
        """Whether ``tenant``'s blocks in ``tier`` stay against other tenants' evictions: it has a quota
        there and holds no more than it."""
        if not self.on or tenant is None:
            return False
        u = self.tenants.get(tenant)
        q = None if u is None else u.quota[tier]
        return q is not None and u is not None and u.used[tier] <= q

    def excess(self, tier: str) -> dict[str, int]:
        """Per tenant over its quota in ``tier``, the bytes it holds beyond it."""
        if not self.on:
            return {}
        return {t: u.used[tier] - q for t, u in self.tenants.items()
                if (q := u.quota[tier]) is not None and u.used[tier] > q}

    def snapshot(self) -> dict[str, dict]:
        """Per tenant: bytes used and quota per tier, hits, misses and the hit rate (None before either)."""
        return {t: {"used": dict(u.used), "quota": dict(u.quota), "hits": u.hits, "misses": u.misses,
                    "hit_rate": round(u.hits / (u.hits + u.misses), 4) if u.hits + u.misses else None}
                for t, u in self.tenants.items()}

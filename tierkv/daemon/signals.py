"""What the engine's requests tell the policies: the chains a request uses, the blocks a commit
stores, a finished request's tail, attention mass per block, the new blocks an engine offers to store.
The reuse models (host reuse, disk admission), the disk order's shadow and the store gate learn from
them; the reuse models are kept across restarts."""

from __future__ import annotations

from tierkv.cache.admission import Admission
from tierkv.cache.block import Block, Session
from tierkv.cache.costmodel import CostModel
from tierkv.cache.managers import TierManagers
from tierkv.cache.reuse import ReuseModel
from tierkv.cache.store_gate import BlockCosts, StoreGate
from tierkv.daemon.context import Context


class Signals:
    """Feeds the reuse models and the policies from requests, commits and the engine's signals."""

    def __init__(self, ctx: Context, m: TierManagers, models: tuple[ReuseModel, Admission], gate: StoreGate,
                 cost: CostModel) -> None:
        """The managers whose policies learn (and the records they keep), the reuse models (host reuse,
        disk admission), the store gate and the cost model its offers are weighed with."""
        self.ctx = ctx
        self.table = m.table
        self.hostm = m.host
        self.diskm = m.disk
        self.host_reuse, self.admission = models
        self.disk_on = m.disk.present
        self.quotas = m.quotas
        self.gate = gate
        self.cost = cost

    def requested(self, s: Session, keys: list[bytes]) -> None:
        """A request uses its prefix chain ``keys`` (fetch, acquire, prefetch; a lookup is only a
        query, and clients mostly answer it from the shared index): the reuse models learn from it."""
        fks, now = [s.fp + k for k in keys], self.ctx.clock()
        with self.ctx.lock:
            for fk in fks:
                self.gate.read(fk)
            self.host_reuse.requested(fks, now)
            if self.ctx.cfg.disk.admission == "predicted":
                self.admission.requested(fks, now)
            if self.disk_on:
                self.disk_referenced(fks)

    def disk_referenced(self, fks: list[bytes]) -> None:
        """The blocks of chain ``fks`` that host memory does not hold are the disk tier's references
        (its policy's shadow compares orders on them). Lock held."""
        if self.diskm.policy.shadow is None:
            return  # no shadow to feed (another policy, or disk.order_shadow_rate 0): no walk per request
        ref, table, parent = self.diskm.policy.referenced, self.table, None
        for fk in fks:
            b = table.get(fk)
            if b is None or b.host_off is None:
                ref(fk, parent)
            parent = fk

    def computed(self, new: list[Block]) -> None:
        """Blocks a commit added: computed, held by no tier, so a reference at the disk's level too. Lock held."""
        if self.disk_on and self.diskm.policy.shadow is not None:
            for b in new:
                self.diskm.policy.referenced(b.fk, b.parent)

    def stored(self, fks: list[bytes], starts: dict[int, bytes | None]) -> None:
        """A commit stored chains ``fks`` (each chain starting at an index of ``starts``). Lock held."""
        now = self.ctx.clock()
        bounds = sorted({0, *starts, len(fks)})
        for lo, hi in zip(bounds, bounds[1:]):  # each chain on its own, continuing its parent
            self.host_reuse.stored(fks[lo:hi], now, starts.get(lo))
            if self.ctx.cfg.disk.admission == "predicted":
                self.admission.stored(fks[lo:hi], now, starts.get(lo))

    def offered(self, s: Session, offers: list[tuple[bytes | None, list[bytes], int, bool, str | None]]
                ) -> list[tuple[int, int]]:
        """Requests' new blocks offered for storing (``(root, keys, first, cut, tenant)`` each): the store
        gate learns from them and says how many leading keys of each are worth storing now, and how many
        if the engine is idle when the request ends; a tenant's are its misses."""
        assert s.ns is not None  # the handler checked the connection's namespace
        lo = s.ns.layout
        cost = self.cost

        def recompute_s(position: int) -> float:
            return cost.recompute_seconds(lo.block_tokens, position * lo.block_tokens)

        costs = BlockCosts(recompute_s, lo.block_bytes / self.ctx.cfg.store.cost_bytes_per_s)
        with self.ctx.lock:
            for _root, keys, _first, _cut, tenant in offers:
                self.quotas.missed(tenant, len(keys))
            return [self.gate.decide((s.fp, root), [s.fp + k for k in keys], first, costs, cut)
                    for root, keys, first, cut, _tenant in offers]

    def request_finished(self, s: Session, keys: list[bytes], output_tokens: int | None = None) -> int:
        """The engine finished a request whose prompt and output chain is ``keys`` (``output_tokens``
        generated, if it says): a conversation tail its next turn may extend. Returns how many of the
        keys are cached."""
        fks = [s.fp + k for k in keys]
        with self.ctx.lock:
            now = self.ctx.clock()
            self.host_reuse.request_finished(fks, now, output_tokens)
            self.admission.request_finished(fks, now, output_tokens)
            return sum(1 for fk in fks if fk in self.table)

    def touch(self, s: Session, keys: list[bytes], scores: list[float]) -> int:
        """Record attention mass per block (1.0 = uniform) for the policies; returns blocks found."""
        found = 0
        with self.ctx.lock:
            for k, mass in zip(keys, scores):
                b = self.table.get(s.fp + k)
                if b is None:
                    continue
                found += 1
                self.hostm.report_mass(b, mass)
        return found

    def learned_models(self) -> dict[str, ReuseModel]:
        """The reuse models whose class counts are kept across restarts."""
        return learned_models(self.host_reuse, self.admission)


def learned_models(host_reuse: ReuseModel, admission: Admission) -> dict[str, ReuseModel]:
    """The reuse models whose class counts are kept across restarts, by name."""
    return {"host": host_reuse, "disk": admission.model, "disk-eviction": admission.evict_model,
            "disk-floor": admission.floor_model}

"""The host tier's manager: host slots and the host policy, and every transition of a block's host copy.

Plain code with no threads and no I/O; the daemon's store holds its lock around every call. Only this
manager writes a record's host fields (:data:`~tierkv.cache.block.TIER_FIELDS`): a slot is assigned
(:meth:`HostManager.assign`) and filled by a store (:meth:`~HostManager.committed`), a load
(:meth:`~HostManager.prepare_load` / :meth:`~HostManager.complete_load`) or a drain from the device
(:meth:`~HostManager.complete_receive`); it is read by leases and by writes to colder tiers
(:meth:`~HostManager.lease`, :meth:`~HostManager.prepare_write`), pinned, and freed when the block
leaves (:meth:`~HostManager.drop`). Each copy gained or lost is reported to the store's
:class:`~tierkv.cache.tier_changes.TierChanges`. Which dirty blocks go to disk, and when, is
:mod:`tierkv.cache.host_outflow`'s decision.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from tierkv.cache.admission import Admission
from tierkv.cache.block import Block, LoadSignal
from tierkv.cache.counters import TierCounters
from tierkv.cache.disk_manager import DiskManager
from tierkv.cache.policy import Policy
from tierkv.cache.quotas import Quotas
from tierkv.cache.reuse import ReuseModel
from tierkv.cache.table import BlockTable
from tierkv.cache.tier_changes import TierChanges

if TYPE_CHECKING:
    from tierkv.daemon.sections import DiskConfig, HostConfig
    from tierkv.tiers.host import SlabAllocator

__all__ = ["HostManager"]
_CHAIN = b""  # HostManager.inserted: the block's own chain parent (no key is empty)


class HostManager:
    """Host slots: allocation under the effective limit, eviction of clean blocks, the host copy's life.

    Args:
        table: the block records.
        pool: the host pool's allocator.
        policy: the host tier's eviction policy.
        disk: the disk tier's manager (absent when the disk tier is off).
        reuse: the host's reuse model (told of every block that leaves).
        admission: the disk's admission rule (which dirty blocks are worth a disk write).
        settings: the ``host`` and ``disk`` settings (:meth:`configure` replaces them).
        writer_idle: whether the disk writer has no backlog (spare bandwidth).
        changes: where copies gained and lost are reported.
        quotas: the tenants' quotas and use (shared with the disk manager).
        clock: what the reuse models and the admission rule are told is now.
    """

    def __init__(self, table: BlockTable, pool: SlabAllocator, policy: Policy[bytes], disk: DiskManager,
                 reuse: ReuseModel, admission: Admission, settings: tuple[HostConfig, DiskConfig],
                 writer_idle: Callable[[], bool], changes: TierChanges, quotas: Quotas | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.table, self.pool, self.policy, self.disk = table, pool, policy, disk
        self.quotas = quotas if quotas is not None else Quotas()
        self.reuse, self.admission, self.writer_idle, self.changes = reuse, admission, writer_idle, changes
        self.clock, self.pinned_bytes = clock, 0
        self.host_cfg, self.disk_cfg = settings
        self.limit = min(pool.capacity, self.host_cfg.capacity)  # effective capacity: `tune host.capacity` lowers it
        self.stats = TierCounters()

    def configure(self, host: HostConfig, disk: DiskConfig) -> None:
        """New settings (``tierkv tune``): the watermarks, the effective capacity, the admission mode."""
        self.host_cfg, self.disk_cfg = host, disk
        self.limit = min(self.pool.capacity, host.capacity)

    # ---- slots ------------------------------------------------------------------------------------
    def alloc_free(self, slot: int) -> int | None:
        """A free slot under the limit, or None (nothing is evicted)."""
        return self.pool.alloc(slot) if self.pool.used_bytes + slot <= self.limit else None

    def above_high(self) -> bool:
        """Usage is above the high watermark: the evictor should run."""
        return self.pool.used_bytes > self.host_cfg.high_watermark * self.limit

    def evict_for(self, nbytes: int) -> int:
        """Drop clean blocks for ``nbytes`` of new slots in one policy walk; returns blocks dropped."""
        victims = self.policy.victims(nbytes, self.protected_clean) or ()
        for fk in victims:
            b = self.table.blocks[fk]
            if self.disk.present:
                self.admission.departed(fk, self.disk.estimate(b.nbytes), b.on_disk)
            self.drop(b)
        return len(victims)

    def drop_unwritten(self, nbytes: int) -> int:
        """Drop dirty blocks (in the policy's order) for ``nbytes`` of new slots without writing them: a
        store must not wait for the disk writer, and a block the writer could not reach in time is a
        later miss, never a stalled step. Blocks in use or pinned stay. Returns blocks dropped."""
        victims = self.policy.victims_past_busy(nbytes, self.protected) or ()
        for fk in victims:
            b = self.table.blocks[fk]
            if not b.on_disk and self.disk.present:
                self.stats.dropped_unwritten += 1
            self.drop(b)
        return len(victims)

    def make_room(self, nbytes: int) -> int:
        """Evict so ``nbytes`` of new slots fit under the limit in one policy walk; returns blocks dropped."""
        short = self.pool.used_bytes + nbytes - self.limit
        return self.evict_for(short) if short > 0 else 0

    # ---- the host copy ----------------------------------------------------------------------------
    def assign(self, b: Block, off: int) -> None:
        """``b`` gets host slot ``off`` (filled next: by a load, a drain or the client's bytes)."""
        assert b.host_off is None
        b.host_off = off
        self.quotas.add(b.tenant, "host", self.pool.slot_size_at(off))
        self.changes.gained(b, "host")

    def inserted(self, b: Block, parent: bytes | None = _CHAIN) -> None:
        """``b``'s host slot holds its bytes: the policy may evict it (after ``parent``, by default the
        block's chain parent)."""
        assert b.host_off is not None
        self.policy.on_insert(b.fk, self.pool.slot_size_at(b.host_off), b.parent if parent == _CHAIN else parent)

    def committed(self, b: Block, off: int, parent: bytes | None) -> None:
        """A store published ``b``, new, in its host slot ``off`` (after ``parent``): a use, and bytes in."""
        self.assign(b, off)
        self.inserted(b, parent)
        self.policy.on_access(b.fk)  # a store is a use (insert alone is not counted)
        self.stats.stored(b.nbytes)

    def kept(self, b: Block, off: int, parent: bytes | None, tokens: bytes | None) -> None:
        """A store brought ``b``, held by a colder tier only, back into host slot ``off``: the fresh copy
        stays hot instead of being read back."""
        if tokens and b.tokens is None:
            b.tokens = tokens
        self.assign(b, off)
        self.inserted(b, parent)

    def prepare_load(self, b: Block, off: int, signal: LoadSignal) -> None:
        """A load (from disk, the remote tier or the device) starts filling host slot ``off`` for ``b``;
        ``signal`` is set once :meth:`complete_load` (or :meth:`complete_receive`) settled it."""
        self.assign(b, off)
        b.loading, b.load_failed = signal, False

    def complete_load(self, b: Block, ok: bool, source: TierCounters, promotion: bool = False) -> LoadSignal | None:
        """A load from a colder tier into ``b``'s host slot ended: a hit of ``source`` (a promotion, if it
        counts as one), or a miss, and the block is dropped everywhere (never served from that value).
        Returns the load's signal, for the caller to set once the record is settled."""
        ev, b.loading = b.loading, None
        if ok:
            self.inserted(b)
            source.hit(b.nbytes)
            self.stats.promotions += promotion
        else:
            self.free_failed(b)
            source.miss()
            self.disk.forget(b)
        return ev

    def complete_receive(self, b: Block, ok: bool) -> LoadSignal | None:
        """A copy from the device into ``b``'s host slot ended (a failed one frees the slot); returns its
        signal, as :meth:`complete_load`."""
        ev, b.loading = b.loading, None
        if ok:
            self.inserted(b)
            self.stats.stored(b.nbytes)
        else:
            self.free_failed(b)
        return ev

    def free_failed(self, b: Block) -> None:
        """Give back the slot of a load that failed (or never started); the block is never served from it."""
        assert b.host_off is not None
        b.load_failed = True
        self._free(b)
        self.changes.lost(b, "host")

    def drop(self, b: Block) -> None:
        """Free a block's host slot (it stays in the colder tiers that hold it)."""
        assert b.host_off is not None
        self.reuse.left(b.fk, self.clock(), len(self.policy))
        self.policy.on_remove(b.fk)
        self._free(b)
        self.stats.evictions += 1
        self.stats.demotions += b.on_disk
        if not b.on_disk and b.gpu_off is None:
            self.disk.forget(b)

    def delete(self, b: Block) -> None:
        """A client deleted ``b``: its host slot goes (not an eviction)."""
        if b.host_off is not None:
            self.policy.on_remove(b.fk)
            self._free(b)

    def _free(self, b: Block) -> None:
        assert b.host_off is not None
        self.quotas.add(b.tenant, "host", -self.pool.slot_size_at(b.host_off))
        self.pool.free(b.host_off)
        b.host_off = None
        self.changes.lost(b, "host")

    # ---- readers of the slot ----------------------------------------------------------------------
    def lease(self, b: Block) -> None:
        """A client (or a copy out of the slot) reads ``b``'s host slot until :meth:`unlease`."""
        b.leases += 1

    def unlease(self, b: Block) -> None:
        """One reader of ``b``'s host slot is done."""
        b.leases -= 1
        assert b.leases >= 0

    def prepare_write(self, blocks: Iterable[Block]) -> None:
        """Writes to a colder tier start reading these slots (they stay until :meth:`complete_write`)."""
        for b in blocks:
            b.writing += 1

    def complete_write(self, b: Block) -> None:
        """A write out of ``b``'s slot ended."""
        b.writing -= 1

    def served(self, b: Block) -> None:
        """``b`` is leased to a client from its host slot: a hit, its bytes read out of the tier."""
        self.stats.hit(b.nbytes)
        self.quotas.hit(b.tenant)

    def missed(self) -> None:
        """A block a fetch asked for was not in host memory."""
        self.stats.miss()

    def prefetching(self, n: int) -> None:
        """``n`` loads into host slots started ahead of their requests."""
        self.stats.prefetched(n)

    def touch(self, b: Block) -> None:
        """A use of ``b`` for the policies of the tiers holding it."""
        b.hits += 1
        if b.host_ready and b.fk in self.policy:
            self.policy.on_access(b.fk)
        if b.on_disk:
            self.disk.policy.on_access(b.fk)

    def report_mass(self, b: Block, mass: float) -> None:
        """A client reported ``b``'s attention mass (1.0 = uniform) for the policies."""
        b.mass = mass
        if b.fk in self.policy:
            self.policy.on_touch(b.fk, mass)
        if b.on_disk:
            self.disk.policy.on_touch(b.fk, mass)

    # ---- pins -------------------------------------------------------------------------------------
    def pin(self, b: Block, priority: int, count: int = 1) -> None:
        """``count`` more pins keep ``b`` in its slot (counted against ``host.max_pinned_fraction``)."""
        assert b.host_off is not None
        if b.pin == 0:
            self.pinned_bytes += self.pool.slot_size_at(b.host_off)
        b.pin = max(b.pin, priority)
        b.pins += count

    def unpin(self, b: Block, every: bool = False) -> bool:
        """One pin of ``b`` ends (``every``: all); whether it was pinned."""
        if not b.pin:
            return False
        b.pins = 0 if every else b.pins - 1
        if b.pins <= 0:
            b.pin, b.pins = 0, 0
            if b.host_off is not None:
                self.pinned_bytes -= self.pool.slot_size_at(b.host_off)
        return True

    # ---- protection -------------------------------------------------------------------------------
    def holds_children(self, fk: bytes) -> bool:
        """Whether host memory holds a block whose chain parent is ``fk`` (as far as its policy keeps
        chains): the disk keeps ``fk`` while it can."""
        return self.policy.has_children(fk)

    def protected(self, fk: bytes) -> bool:
        """The slot stays: in use (leased, read by a transfer, being filled or pinned), or its tenant holds
        no more than its quota here."""
        b = self.table.blocks[fk]
        return b.protected or self.quotas.shielded(b.tenant, "host")

    def protected_clean(self, fk: bytes) -> bool:
        """A store making room skips this block: it stays (:meth:`protected`), or it is dirty and worth
        writing first (write-behind cleans such blocks ahead, so a burst that fits the clean part of the
        tier does not wait)."""
        b = self.table.blocks[fk]
        return b.protected or self.quotas.shielded(b.tenant, "host") or (
            not b.on_disk and self.disk.present and self.worth_writing(b, self.disk_cfg.admission))

    def evictable_exists(self) -> bool:
        """Whether waiting can help: some block is held by neither a client nor a pin (blocks being
        written back or loaded become evictable when their transfer ends)."""
        blocks = self.table.blocks
        return self.policy.victims(1, lambda fk: blocks[fk].leases > 0 or blocks[fk].pin > 0) is not None

    def worth_writing(self, b: Block, mode: str) -> bool:
        """Whether the admission rule, in ``mode`` (the disk's or the remote tier's), writes ``b`` to a
        colder tier: every block, the ones the rule predicts are read again (every one but the tails
        under its floor while the writer keeps up), the reused ones or the pinned ones."""
        return self.admission.wants(b.fk, self.clock(), hits=b.hits, sharers=b.leases, pinned=b.pin > 0,
                                    spare=mode == "predicted" and self.writer_idle(), mode=mode)

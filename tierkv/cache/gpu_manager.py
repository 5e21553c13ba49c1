"""The GPU tier's manager: device slots under plain recency (a copy is clean once drained to host memory),
and every transition of a block's GPU copy: committed there (the only copy until drained), loaded from
host memory (:meth:`GpuManager.prepare_load` / :meth:`~GpuManager.complete_load`), leased, drained into
host memory (:meth:`~GpuManager.prepare_drain` / :meth:`~GpuManager.complete_drain`), dropped.

Plain code with no threads and no I/O; the daemon's store holds its lock around every call. Only this
manager writes a record's GPU fields, and it reports each copy gained or lost. A daemon without a GPU
tier has a manager whose :attr:`~GpuManager.present` is False (and holds nothing).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierkv.cache.block import Block, LoadSignal
from tierkv.cache.counters import TierCounters
from tierkv.cache.disk_manager import DiskManager
from tierkv.cache.host_manager import HostManager
from tierkv.cache.policy import Policy
from tierkv.cache.table import BlockTable
from tierkv.cache.tier_changes import TierChanges

if TYPE_CHECKING:
    from tierkv.tiers.host import SlabAllocator

__all__ = ["GpuManager"]


class GpuManager:
    """Device slots: clean copies are dropped under plain recency; drains keep the only copy.

    Args:
        table: the block records.
        pool: the device pool's allocator (None: no GPU tier).
        policy: the device tier's eviction policy.
        disk: the disk tier's manager (a block no tier holds is forgotten through it).
        changes: where copies gained and lost are reported.
    """

    def __init__(self, table: BlockTable, pool: SlabAllocator | None, policy: Policy[bytes], disk: DiskManager,
                 changes: TierChanges) -> None:
        self.table, self._pool, self.policy, self.disk = table, pool, policy, disk
        self.changes = changes
        self.present = pool is not None
        self.stats = TierCounters()
        self.undrained: list[Block] = []  # GPU commits waiting for a host slot to drain into (retried)

    @property
    def pool(self) -> SlabAllocator:
        """The device pool (only asked for when the tier is present)."""
        assert self._pool is not None, "the GPU tier is off"
        return self._pool

    def protected(self, fk: bytes) -> bool:
        """The device slot is in use (leased, being filled, or the only copy)."""
        return self.table.blocks[fk].gpu_protected

    def alloc(self, slot: int) -> int | None:
        """A device slot, dropping clean device copies; None when every block is in use."""
        while True:
            off = self.pool.alloc(slot)
            if off is not None:
                return off
            victims = self.policy.victims(slot, self.protected)
            if not victims:
                return None
            for fk in victims:
                self.drop(self.table.blocks[fk])

    def _assign(self, b: Block, off: int) -> None:
        assert b.gpu_off is None
        b.gpu_off = off
        self.changes.gained(b, "gpu")

    def inserted(self, b: Block) -> None:
        """``b``'s device slot holds its bytes."""
        assert b.gpu_off is not None
        self.policy.on_insert(b.fk, self.pool.slot_size_at(b.gpu_off), None)

    def committed(self, b: Block, off: int) -> None:
        """A store published ``b``, new, in device slot ``off``: its only copy until drained; bytes in."""
        self._assign(b, off)
        b.draining = True
        self.inserted(b)
        self.stats.stored(b.nbytes)

    def kept(self, b: Block, off: int) -> None:
        """A store brought ``b``, cached in a colder tier, into device slot ``off``: the fresh copy stays hot."""
        self._assign(b, off)
        self.inserted(b)

    def lease(self, b: Block) -> None:
        """A client (or a drain out of the slot) reads ``b``'s device slot until :meth:`unlease`."""
        b.gpu_leases += 1

    def unlease(self, b: Block) -> None:
        """One reader of ``b``'s device slot is done."""
        b.gpu_leases -= 1
        assert b.gpu_leases >= 0

    def served(self, b: Block) -> None:
        """A fetch found ``b`` in its device slot: a hit and a use."""
        self.stats.hit()
        self.policy.on_access(b.fk)
        b.hits += 1

    def missed(self) -> None:
        """A block a fetch asked for was not on the device."""
        self.stats.miss()

    def prepare_load(self, b: Block, off: int, signal: LoadSignal) -> None:
        """A copy from host memory starts filling device slot ``off`` for ``b``; ``signal`` is set once
        :meth:`complete_load` settled it."""
        self._assign(b, off)
        b.gpu_loading = signal

    def complete_load(self, b: Block, ok: bool) -> LoadSignal | None:
        """A copy into ``b``'s device slot finished; a failed one (its source never arrived) frees it.
        Returns the copy's signal, for the caller to set once the record is settled."""
        assert b.gpu_off is not None  # set when the load started
        ev, b.gpu_loading = b.gpu_loading, None
        if ok:
            self.inserted(b)
            self.stats.promotions += 1
            self.stats.stored(b.nbytes)
        else:
            self.pool.free(b.gpu_off)
            b.gpu_off = None
            self.changes.lost(b, "gpu")
        return ev

    def prepare_drain(self, b: Block, host: HostManager, off: int, signal: LoadSignal) -> None:
        """A copy of ``b`` from its device slot (read until :meth:`complete_drain`) starts filling host
        slot ``off``."""
        host.prepare_load(b, off, signal)
        self.lease(b)

    def complete_drain(self, b: Block, host: HostManager, ok: bool) -> LoadSignal | None:
        """A copy of ``b`` from its device slot into host memory finished (a failed one, while the device
        copy is the only one, puts ``b`` on :attr:`undrained`). Returns the copy's signal, for the caller
        to set once the record is settled."""
        ev = host.complete_receive(b, ok)
        self.unlease(b)
        if ok:
            b.draining = False
            self.stats.demotions += 1
            return ev
        self.stats.failed()
        if b.draining:
            self.undrained.append(b)  # the device copy is still the only one: drained again later
        return ev

    def drop(self, b: Block) -> None:
        """Free a block's device slot; it stays in the colder tiers that hold it."""
        assert b.gpu_off is not None
        self.policy.on_remove(b.fk)
        self.pool.free(b.gpu_off)
        b.gpu_off = None
        self.changes.lost(b, "gpu")
        self.stats.evictions += 1
        if b.host_off is None and not b.on_disk:
            self.disk.forget(b)

    def delete(self, b: Block) -> None:
        """A client deleted ``b``: its device slot goes (not an eviction)."""
        if b.gpu_off is not None:
            self.policy.on_remove(b.fk)
            self.pool.free(b.gpu_off)
            b.gpu_off = None
            self.changes.lost(b, "gpu")

    def draining(self) -> bool:
        """Some block's only copy is on the device (waiting helps: its drain frees the slot's pin)."""
        return any(b.draining for b in self.table.records() if b.gpu_off is not None)

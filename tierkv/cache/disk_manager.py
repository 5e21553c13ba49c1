"""The disk tier's manager: bytes on disk and reserved for writes in flight, the disk policy, the
victims that make room for a write, and every transition of a block's disk copy: found by the start-up
scan (:meth:`DiskManager.found`), stored (:meth:`~DiskManager.prepare_store` /
:meth:`~DiskManager.complete_store` / :meth:`~DiskManager.store_settled`), removed, and a read that failed.

Decisions only, plain code with no threads and no I/O; the daemon's store holds its lock around every
call. Only this manager writes a record's disk fields, and it reports each copy gained or lost. A daemon
without a disk tier has a manager whose :attr:`~DiskManager.present` is False (and holds nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tierkv.cache.block import Block
from tierkv.cache.counters import TierCounters
from tierkv.cache.policy import Policy
from tierkv.cache.quotas import Quotas
from tierkv.cache.table import BlockTable
from tierkv.cache.tier_changes import TierChanges
from tierkv.core.errors import TierFull

if TYPE_CHECKING:
    from tierkv.daemon.sections import DiskConfig


def _nothing_above(_fk: bytes) -> bool:
    return False


class DiskManager:
    """The disk tier's bookkeeping: bytes used, its policy, and victims when a write needs room.

    Args:
        table: the block records.
        policy: the disk tier's eviction policy.
        settings: the ``disk`` settings (its watermarks); ``tierkv tune`` replaces them.
        capacity: the disk tier's capacity now (``tune disk.capacity`` changes it).
        stored_size: the bytes a value of n bytes takes in the tier (its page rounding).
        changes: where copies gained and lost are reported.
        present: False when the daemon runs without a disk tier.
        quotas: the tenants' quotas and use (the host manager's too).
    """

    def __init__(self, table: BlockTable, policy: Policy[bytes], settings: DiskConfig, capacity: Callable[[], int],
                 stored_size: Callable[[int], int], changes: TierChanges, present: bool = True,
                 quotas: Quotas | None = None) -> None:
        self.table, self.policy, self.settings = table, policy, settings
        self.quotas = quotas if quotas is not None else Quotas()
        self.changes = changes
        self.present = present
        self.capacity = capacity
        self.stored_size = stored_size
        self.used = 0
        self.reserved = 0  # estimated bytes of writes queued or in flight (room made for them)
        self.pinned_bytes = 0  # raw bytes of the blocks pinned on disk
        self.stats = TierCounters()
        # whether the tier above holds a chain child of the block: its prefix stays while room allows
        self.needed_above: Callable[[bytes], bool] = _nothing_above

    def found(self, b: Block, stored_bytes: int) -> None:
        """The start-up scan found ``b``'s value on disk (``stored_bytes`` encoded)."""
        b.on_disk, b.disk_bytes = True, stored_bytes
        self.changes.gained(b, "disk")
        self.added(b)

    def added(self, b: Block) -> None:
        """``b``'s value reached disk (its ``disk_bytes`` set): counted and known to the policy."""
        self.used += self.stored_size(b.disk_bytes)
        self.quotas.add(b.tenant, "disk", self.stored_size(b.disk_bytes))
        self.stats.bytes_logical += b.nbytes
        self.stats.bytes_stored += b.disk_bytes
        self.policy.on_insert(b.fk, self.stored_size(b.disk_bytes), b.parent)

    def removed(self, b: Block) -> None:
        """``b``'s value is gone from disk (or about to be deleted); its disk pins with it."""
        self.unpin(b, every=True)
        self.used -= self.stored_size(b.disk_bytes)
        self.quotas.add(b.tenant, "disk", -self.stored_size(b.disk_bytes))
        self.stats.bytes_logical -= b.nbytes
        self.stats.bytes_stored -= b.disk_bytes
        self.policy.on_remove(b.fk)
        b.on_disk = False
        b.disk_bytes = 0
        self.changes.lost(b, "disk")

    def forget(self, b: Block) -> None:
        """Remove a block that no local tier holds any more (a copy the remote tier may hold is no longer
        known either)."""
        if b.on_disk:
            self.removed(b)
        for tier in b.held():
            self.changes.lost(b, tier)
        self.table.remove(b)

    # ---- pins -------------------------------------------------------------------------------------
    def pin(self, b: Block, count: int = 1) -> None:
        """Keep ``b``'s value on disk (written or being written) until unpinned as many times."""
        if b.disk_pins == 0:
            self.pinned_bytes += b.nbytes
        b.disk_pins += count

    def unpin(self, b: Block, every: bool = False) -> bool:
        """One disk pin of ``b`` ends (``every``: all of them); whether it had one."""
        if not b.disk_pins:
            return False
        b.disk_pins = 0 if every else b.disk_pins - 1
        if b.disk_pins == 0:
            self.pinned_bytes -= b.nbytes
        return True

    def configure(self, settings: DiskConfig) -> None:
        """New ``disk`` settings (``tierkv tune``)."""
        self.settings = settings

    def protected(self, fk: bytes) -> bool:
        """A value being read into the host tier stays, and so do a block's pinned in host memory (a
        restart pins it again from there) or on disk and the values of a tenant holding no more than its
        disk quota."""
        b = self.table.get(fk)
        return (b is None or b.loading is not None or b.pin > 0 or b.disk_pins > 0
                or self.quotas.shielded(b.tenant, "disk"))

    def needed(self, fk: bytes) -> bool:
        """Besides :meth:`protected`: the prefix of a block host memory holds stays (dropped, it would
        leave a hole in the chain, and the host block after it could never be a hit)."""
        return self.protected(fk) or self.needed_above(fk)

    def room(self, incoming: int) -> list[bytes]:
        """Keys to delete so ``incoming`` bytes fit under the high watermark (down to the low one):
        blocks no host block needs as its prefix first, others only when those are not enough.

        Raises:
            TierFull: nothing can be dropped.
        """
        # tenants over their disk quota give up their own values first
        own = self._drop([fk for t, n in self.quotas.excess("disk").items() for fk in self._own(t, n)])
        cap, used = self.capacity(), self.used + self.reserved
        limit = self.settings.high_watermark * cap
        if used + incoming <= limit:
            return own
        target, least = used + incoming - self.settings.low_watermark * cap, used + incoming - limit
        victims = None
        for keep in (self.needed, self.protected):
            victims = self.policy.victims(int(target), keep) or self.policy.victims(int(least), keep)
            if victims is not None:
                break
        if victims is None:
            if own:
                return own
            raise TierFull("disk tier is full and nothing can be dropped")
        return own + self._drop(list(victims))

    def _own(self, tenant: str, nbytes: int) -> list[bytes]:
        def other(fk: bytes) -> bool:
            b = self.table.blocks[fk]
            return b.loading is not None or b.tenant != tenant
        return self.policy.victims(nbytes, other) or []

    def _drop(self, victims: list[bytes]) -> list[bytes]:
        """Remove ``victims`` from the tier's accounts (the write deletes them); forget those no tier holds."""
        for fk in victims:
            b = self.table.blocks[fk]
            self.removed(b)
            self.stats.evictions += 1
            if b.host_off is None and b.gpu_off is None:
                self.forget(b)
        return list(victims)

    # ---- writes -----------------------------------------------------------------------------------
    def estimate(self, nbytes: int) -> int:
        """About the bytes a block of ``nbytes`` takes on disk (at the compression so far)."""
        s = self.stats
        ratio = s.bytes_stored / s.bytes_logical if s.bytes_logical > 0 else 1.0
        return self.stored_size(max(1, int(nbytes * ratio)))

    def prepare_store(self, blocks: list[Block]) -> tuple[list[bytes], int]:
        """Make room for a write of ``blocks``: the keys to delete with it, and the bytes reserved for it
        until :meth:`store_settled`.

        Raises:
            TierFull: nothing can be dropped (nothing is reserved).
        """
        incoming = sum(self.estimate(b.nbytes) for b in blocks)
        deletes = self.room(incoming)
        self.reserved += incoming
        return deletes, incoming

    def complete_store(self, b: Block, stored_bytes: int) -> None:
        """A write put ``b``'s value on disk (unless the block was removed or counted meanwhile)."""
        if b.on_disk or b.fk not in self.table:
            return
        b.on_disk = True
        b.disk_bytes = stored_bytes
        self.changes.gained(b, "disk")
        self.added(b)
        self.stats.bytes_in += b.nbytes

    def store_settled(self, reserved: int, failed: bool) -> None:
        """A write finished: its reservation ends (its values are counted by :meth:`complete_store`)."""
        self.reserved -= reserved
        self.stats.errors += failed

    def write_refused(self) -> None:
        """A write found the disk full with nothing to drop: it fails at once."""
        self.stats.failed()

    def corrupt_dropped(self, n: int) -> None:
        """``n`` stored values were found bad (a scan or ``verify``) and are deleted."""
        self.stats.corrupt_dropped(n)

    def read_failed(self, error: str) -> bool:
        """Count a value that did not load; True when the value is bad (delete it), not the disk."""
        if error.startswith("io"):
            self.stats.errors += 1
            return False
        if error.startswith("foreign"):
            self.stats.foreign_dropped(1)
        else:
            self.stats.corrupt += 1
        return True

"""The managers of one store's tiers, fastest first, and the changes they report.

Every tier has a manager (:mod:`~tierkv.cache.gpu_manager`, :mod:`~tierkv.cache.host_manager`,
:mod:`~tierkv.cache.disk_manager`, :mod:`~tierkv.cache.remote_manager`), a tier that is off one whose
``present`` is False; the daemon's paths and ``tierkv replay`` sequence them and never write a record's
tier fields themselves.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from tierkv.cache.block import Block, Lease
from tierkv.cache.disk_manager import DiskManager
from tierkv.cache.gpu_manager import GpuManager
from tierkv.cache.host_manager import HostManager
from tierkv.cache.host_outflow import HostOutflow
from tierkv.cache.quotas import Quotas
from tierkv.cache.remote_manager import RemoteManager
from tierkv.cache.table import BlockTable
from tierkv.cache.tier_changes import TierChanges

__all__ = ["LOCAL_TIERS", "TierManagers"]

LOCAL_TIERS = frozenset({"gpu", "host", "disk"})


@dataclass
class TierManagers:
    """One store's block records, its tier managers, the host tier's outflow to disk, and the changes
    they report."""

    table: BlockTable
    gpu: GpuManager
    host: HostManager
    disk: DiskManager
    remote: RemoteManager
    outflow: HostOutflow
    changes: TierChanges
    quotas: Quotas

    def end_leases(self, leases: Iterable[Lease]) -> None:
        """Each lease's blocks are read no more in the tier it pinned them in."""
        for lease in leases:
            manager = self.gpu if lease.tier == "gpu" else self.host
            for b in lease.blocks:
                manager.unlease(b)

    def set_quota(self, tenant: str, limits: dict[str, int | None]) -> None:
        """Set ``tenant``'s quotas per tier (see :meth:`Quotas.set`), counting what it holds when it had
        none yet.

        Raises:
            ValueError: a bad tier or limit (nothing changes).
        """
        holds: dict[str, int] = {}
        if not self.quotas.accounted(tenant):
            mine = [b for b in self.table.records() if b.tenant == tenant]
            holds = {"host": sum(self.host.pool.slot_size_at(b.host_off) for b in mine if b.host_off is not None),
                     "disk": sum(self.disk.stored_size(b.disk_bytes) for b in mine if b.on_disk)}
        self.quotas.set(tenant, limits, holds)

    def delete(self, b: Block, tiers: Collection[str] = LOCAL_TIERS) -> bool:
        """A client or the operator deleted ``b`` (in use by no tier) from ``tiers``: those copies go, and
        the record with the last local one. Returns whether its value on disk went (the caller deletes
        it there)."""
        on_disk = b.on_disk and "disk" in tiers
        if "gpu" in tiers:
            self.gpu.delete(b)
        if "host" in tiers:
            self.host.delete(b)
        if on_disk:
            self.disk.removed(b)
        if b.gpu_off is None and b.host_off is None and not b.on_disk:
            self.disk.forget(b)
        return on_disk

"""Which host blocks go to disk, and when: demotion between the watermarks (the disk's admission rule
decides which dirty victims are worth the write) and the write-behind batch that cleans cold blocks
ahead of eviction.

Plain code with no threads and no I/O; the evictor holds the store's lock around every call and starts
the writes these decisions ask for.
"""

from __future__ import annotations

from tierkv.cache.admission import Admission
from tierkv.cache.block import Block
from tierkv.cache.host_manager import HostManager

__all__ = ["HostOutflow"]


class HostOutflow:
    """Demotion and write-behind of one host tier over its disk.

    Args:
        host: the host tier's manager (its policy, pool, records and the disk's manager).
        admission: the disk's admission rule.
    The watermarks and the admission mode are the host manager's settings (``host``, ``disk``).
    """

    def __init__(self, host: HostManager, admission: Admission) -> None:
        self.host, self.admission = host, admission
        self.written_behind = 0
        self.write_behind_waits = 0  # write-behind batches deferred: due, but the engine kept the cores busy

    def admit(self, b: Block) -> bool:
        """Whether a host victim is worth a disk write (durable puts and the flush skip this); counted."""
        h, adm = self.host, self.admission
        predicted = adm.mode == "predicted"
        if predicted:
            adm.resize(int(h.disk_cfg.high_watermark * h.disk.capacity()))
        return adm.admit(b.fk, h.clock(), hits=b.hits, sharers=b.leases, pinned=b.pin > 0,
                         spare=predicted and h.writer_idle(), size=h.disk.estimate(b.nbytes) if predicted else 1)

    def demotion(self, force: bool) -> list[Block]:
        """Tenants over their host quota first, else between the watermarks (or when forced): drop clean
        victims at once; returns the dirty victims to write to disk first."""
        h = self.host
        used, cap = h.pool.used_bytes, h.limit
        own = [fk for t, n in h.quotas.excess("host").items() for fk in self._own(t, n)]
        if own:  # tenants over their quota give up their own blocks first
            return self._take(own)
        if used <= h.host_cfg.high_watermark * cap and not force:
            return []
        want = max(int(used - h.host_cfg.low_watermark * cap), h.pool.slab_bytes if force else 0)
        victims = h.policy.victims(want, h.protected)
        if victims is None:
            victims = []
            n = want
            while n > 0 and not victims:  # take what we can: walk down until something is possible
                n //= 2
                victims = h.policy.victims(n, h.protected) or []
        return self._take(victims)

    def _own(self, tenant: str, nbytes: int) -> list[bytes]:
        """About ``nbytes`` of ``tenant``'s own host blocks not in use, in the policy's order."""
        h = self.host

        def other(fk: bytes) -> bool:
            b = h.table.blocks[fk]
            return b.protected or b.tenant != tenant
        return h.policy.victims(nbytes, other) or h.policy.victims(h.pool.slab_bytes, other) or []

    def _take(self, victims: list[bytes]) -> list[Block]:
        """Drop the clean ``victims`` (and those the disk does not admit); returns the dirty ones to write."""
        h = self.host
        dirty = []
        for fk in victims:
            b = h.table.blocks[fk]
            if b.on_disk and h.disk.present:
                self.admission.departed(fk, h.disk.estimate(b.nbytes), True)
            if b.on_disk or not h.disk.present or not self.admit(b):
                h.drop(b)
            else:
                dirty.append(b)
        return dirty

    def demoted(self, dirty: list[Block]) -> None:
        """The write of ``dirty`` finished: free the slots of those on disk and not in use."""
        for b in dirty:
            if b.host_off is not None and not b.protected and b.on_disk:
                self.host.drop(b)

    def write_behind_due(self) -> bool:
        """Whether the host tier is full enough (``host.write_behind_above``) to write behind."""
        return self.host.pool.used_bytes >= self.host.host_cfg.write_behind_above * self.host.limit

    def write_behind_batch(self, batch: int) -> list[Block]:
        """The coldest admitted dirty blocks, about ``batch`` bytes, to clean ahead of eviction."""
        if not self.write_behind_due():
            return []
        h = self.host
        admission = h.disk_cfg.admission

        def skip(fk: bytes) -> bool:
            b = h.table.blocks[fk]
            return b.protected or not h.worth_writing(b, admission)

        # Walk the policy's eviction order (clean blocks included: prefix-aware policies free a
        # parent only after its children) until it holds a batch of dirty blocks.
        blocks, used = h.table.blocks, h.pool.used_bytes
        want, order = min(batch, used), None
        while order is None and want >= 4096:
            order = h.policy.victims(want, skip)
            if order is None:
                want //= 2
        victims: list[bytes] = []
        while order:
            victims = [fk for fk in order if not blocks[fk].on_disk]
            if want >= used or sum(blocks[fk].nbytes for fk in victims) >= batch:
                break
            want = min(want * 2, used)
            order = h.policy.victims(want, skip)
        self.written_behind += len(victims)
        return [blocks[fk] for fk in victims]

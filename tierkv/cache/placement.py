"""Placement: which slot a block gets in each tier, and which blocks leave a tier to make room.

Decisions only, plain code with no threads and no I/O; the daemon's store holds its lock around every
call and starts the transfers these decisions ask for. One class per tier:

- :class:`DiskPlacement` (in :mod:`tierkv.cache.disk_placement`): bytes on disk (and reserved for writes
  in flight), the disk policy, the victims that make room for a write.
- :class:`HostPlacement`: host slots, the host policy, admission to disk, demotion between the
  watermarks and the write-behind batch.
- :class:`GpuPlacement`: device slots under plain recency (clean once drained).

``cfg`` is the daemon's settings object (``host``, ``disk``, ``remote`` sections); ``tierkv tune``
replaces it.

Each class also settles the transfers that end in its tier: the block's copy, the policy's entry and the
counters (hits, bytes, promotions) change in one place, when the daemon hands it a mover's result.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tierkv.cache.admission import Admission
from tierkv.cache.block import Block
from tierkv.cache.counters import TierCounters
from tierkv.cache.disk_placement import DiskPlacement
from tierkv.cache.policy import Policy
from tierkv.cache.reuse import ReuseModel
from tierkv.cache.table import BlockTable

if TYPE_CHECKING:
    from tierkv.tiers.host import SlabAllocator

__all__ = ["DiskPlacement", "GpuPlacement", "HostPlacement"]
_CHAIN = object()  # HostPlacement.inserted: the block's own chain parent


class HostPlacement:
    """Host slots: allocation under the effective limit, eviction of clean blocks, demotion to disk."""

    def __init__(self, table: BlockTable, pool: SlabAllocator, policy: Policy[bytes], disk: DiskPlacement,
                 has_disk: bool, reuse: ReuseModel, admission: Admission, cfg: Any,
                 writer_idle: Callable[[], bool]) -> None:
        self.table, self.pool, self.policy, self.disk, self.has_disk = table, pool, policy, disk, has_disk
        self.reuse, self.admission, self.cfg = reuse, admission, cfg
        self.writer_idle = writer_idle  # whether the disk writer has no backlog (spare bandwidth)
        self.limit = pool.capacity      # effective capacity: `tune host.capacity` can lower it
        self.pinned_bytes = 0
        self.written_behind = 0
        self.write_behind_waits = 0  # write-behind batches deferred: due, but the engine kept the cores busy
        self.stats = TierCounters()

    # ---- slots ------------------------------------------------------------------------------------
    def alloc_free(self, slot: int) -> int | None:
        """A free slot under the limit, or None (nothing is evicted)."""
        return self.pool.alloc(slot) if self.pool.used_bytes + slot <= self.limit else None

    def above_high(self) -> bool:
        """Usage is above the high watermark: the evictor should run."""
        return self.pool.used_bytes > self.cfg.host.high_watermark * self.limit

    def evict_for(self, nbytes: int) -> int:
        """Drop clean blocks for ``nbytes`` of new slots in one policy walk; returns blocks dropped."""
        victims = self.policy.victims(nbytes, self.protected_clean) or ()
        for fk in victims:
            b = self.table.blocks[fk]
            if self.has_disk:
                self.admission.departed(fk, self._disk_size(b), b.on_disk)
            self.drop(b)
        return len(victims)

    def drop_unwritten(self, nbytes: int) -> int:
        """Drop dirty blocks (in the policy's order) for ``nbytes`` of new slots without writing them: a
        store must not wait for the disk writer, and a block the writer could not reach in time is a
        later miss, never a stalled step. Blocks in use or pinned stay. Returns blocks dropped."""
        victims = self.policy.victims_past_busy(nbytes, self.protected) or ()
        for fk in victims:
            b = self.table.blocks[fk]
            if not b.on_disk and self.has_disk:
                self.stats.dropped_unwritten += 1
            self.drop(b)
        return len(victims)

    def make_room(self, nbytes: int) -> int:
        """Evict so ``nbytes`` of new slots fit under the limit (a large put would otherwise walk the
        policy once per slot); returns blocks dropped."""
        short = self.pool.used_bytes + nbytes - self.limit
        return self.evict_for(short) if short > 0 else 0

    def inserted(self, b: Block, parent: Any = _CHAIN) -> None:
        """``b``'s host slot holds its bytes: the policy may evict it (after ``parent``, by default the
        block's chain parent)."""
        assert b.host_off is not None
        self.policy.on_insert(b.fk, self.pool.slot_size_at(b.host_off), b.parent if parent is _CHAIN else parent)

    def drop(self, b: Block) -> None:
        """Free a block's host slot (it stays in the colder tiers that hold it)."""
        assert b.host_off is not None
        self.reuse.left(b.fk, time.monotonic(), len(self.policy))
        self.policy.on_remove(b.fk)
        self.pool.free(b.host_off)
        b.host_off = None
        self.stats.evictions += 1
        if b.on_disk:
            self.stats.demotions += 1
        elif b.gpu_off is None:
            self.disk.forget(b)

    def committed(self, b: Block, parent: bytes | None) -> None:
        """A store published ``b``, new, in its host slot (after ``parent``): a use, and bytes in."""
        self.inserted(b, parent)
        self.policy.on_access(b.fk)  # a store is a use (insert alone is not counted)
        self.stats.stored(b.nbytes)

    def received(self, b: Block) -> None:
        """A copy from the device filled ``b``'s host slot."""
        self.inserted(b)
        self.stats.stored(b.nbytes)

    def served(self, b: Block) -> None:
        """``b`` is leased to a client from its host slot: a hit, its bytes read out of the tier."""
        self.stats.hit(b.nbytes)

    def missed(self) -> None:
        """A block a fetch asked for was not in host memory."""
        self.stats.miss()

    def prefetching(self, n: int) -> None:
        """``n`` loads into host slots started ahead of their requests."""
        self.stats.prefetched(n)

    def loaded(self, b: Block, source: TierCounters, promotion: bool = False) -> None:
        """A load filled ``b``'s host slot: a hit of ``source`` (a promotion, if it counts as one)."""
        self.inserted(b)
        source.hit(b.nbytes)
        self.stats.promotions += promotion

    def load_failed(self, b: Block, source: TierCounters) -> None:
        """A load into ``b``'s host slot failed: a miss of ``source``; the block is dropped everywhere."""
        self.free_failed(b)
        source.miss()
        self.disk.forget(b)

    def free_failed(self, b: Block) -> None:
        """Give back the slot of a load that failed; the block is never served from it."""
        assert b.host_off is not None
        b.load_failed = True
        self.pool.free(b.host_off)
        b.host_off = None

    def touch(self, b: Block) -> None:
        """A use of ``b`` for the policies of the tiers holding it."""
        b.hits += 1
        if b.host_ready and b.fk in self.policy:
            self.policy.on_access(b.fk)
        if b.on_disk:
            self.disk.policy.on_access(b.fk)

    def pinned(self, b: Block) -> None:
        """``b``, in its host slot, became pinned: its slot counts against ``host.max_pinned_fraction``."""
        assert b.host_off is not None
        self.pinned_bytes += self.pool.slot_size_at(b.host_off)

    def unpinned(self, b: Block) -> None:
        """``b`` is pinned no more (its slot, if it holds one, stops counting as pinned)."""
        if b.host_off is not None:
            self.pinned_bytes -= self.pool.slot_size_at(b.host_off)

    # ---- protection -------------------------------------------------------------------------------
    def holds_children(self, fk: bytes) -> bool:
        """Whether host memory holds a block whose chain parent is ``fk`` (as far as its policy keeps
        chains): the disk keeps ``fk`` while it can."""
        return self.policy.has_children(fk)

    def protected(self, fk: bytes) -> bool:
        """The slot is in use (leased, read by a transfer, being filled or pinned)."""
        return self.table.blocks[fk].protected

    def protected_clean(self, fk: bytes) -> bool:
        """A store making room skips this block: in use, or dirty and worth writing first (write-behind
        cleans such blocks ahead, so a burst that fits the clean part of the tier does not wait)."""
        b = self.table.blocks[fk]
        return b.protected or (not b.on_disk and self.has_disk
                               and self.worth_writing(b, self.cfg.disk.admission))

    def evictable_exists(self) -> bool:
        """Whether waiting can help: some block is held by neither a client nor a pin (blocks being
        written back or loaded become evictable when their transfer ends)."""
        def held(fk: bytes) -> bool:
            b = self.table.blocks[fk]
            return b.leases > 0 or b.pin > 0
        return self.policy.victims(1, held) is not None

    # ---- admission --------------------------------------------------------------------------------
    def worth_writing(self, b: Block, mode: str) -> bool:
        """Whether the admission rule, in ``mode`` (the disk's or the remote tier's), writes ``b`` to a
        colder tier: every block, the ones the rule predicts are read again (every one but the tails
        under its floor while the writer keeps up), the reused ones or the pinned ones."""
        return self.admission.wants(b.fk, time.monotonic(), hits=b.hits, sharers=b.leases, pinned=b.pin > 0,
                                    spare=mode == "predicted" and self.writer_idle(), mode=mode)

    def admit(self, b: Block) -> bool:
        """Whether a host victim is worth a disk write (durable puts and the flush skip this); counted."""
        predicted = self.admission.mode == "predicted"
        if predicted:
            self.admission.resize(int(self.cfg.disk.high_watermark * self.disk.capacity()))
        return self.admission.admit(b.fk, time.monotonic(), hits=b.hits, sharers=b.leases, pinned=b.pin > 0,
                                    spare=predicted and self.writer_idle(),
                                    size=self._disk_size(b) if predicted else 1)

    def _disk_size(self, b: Block) -> int:
        """About the bytes ``b`` would take on disk (its size at the disk's compression so far)."""
        return self.disk.estimate(b.nbytes)

    # ---- demotion ---------------------------------------------------------------------------------
    def demotion(self, force: bool) -> list[Block]:
        """Between the watermarks (or when forced): drop clean victims at once; returns the dirty
        victims to write to disk first."""
        cap = self.limit
        if self.pool.used_bytes <= self.cfg.host.high_watermark * cap and not force:
            return []
        want = int(self.pool.used_bytes - self.cfg.host.low_watermark * cap)
        want = max(want, self.pool.slab_bytes if force else 0)
        victims = self.policy.victims(want, self.protected)
        if victims is None:
            victims = []
            n = want
            while n > 0 and not victims:  # take what we can: walk down until something is possible
                n //= 2
                victims = self.policy.victims(n, self.protected) or []
        dirty = []
        for fk in victims:
            b = self.table.blocks[fk]
            if b.on_disk and self.has_disk:
                self.admission.departed(fk, self._disk_size(b), True)
            if b.on_disk or not self.has_disk or not self.admit(b):
                self.drop(b)
            else:
                dirty.append(b)
        return dirty

    def demoted(self, dirty: list[Block]) -> None:
        """The write of ``dirty`` finished: free the slots of those on disk and not in use."""
        for b in dirty:
            if b.host_off is not None and not b.protected and b.on_disk:
                self.drop(b)

    def write_behind_due(self) -> bool:
        """Whether the host tier is full enough (``host.write_behind_above``) to write behind."""
        return self.pool.used_bytes >= self.cfg.host.write_behind_above * self.limit

    def write_behind_batch(self, batch: int) -> list[Block]:
        """The coldest admitted dirty blocks, about ``batch`` bytes, to clean ahead of eviction."""
        if not self.write_behind_due():
            return []
        admission = self.cfg.disk.admission

        def skip(fk: bytes) -> bool:
            b = self.table.blocks[fk]
            return b.protected or not self.worth_writing(b, admission)

        # Walk the policy's eviction order (clean blocks included: prefix-aware policies free a
        # parent only after its children) until it holds a batch of dirty blocks.
        blocks, used = self.table.blocks, self.pool.used_bytes
        want, order = min(batch, used), None
        while order is None and want >= 4096:
            order = self.policy.victims(want, skip)
            if order is None:
                want //= 2
        victims: list[bytes] = []
        while order:
            victims = [fk for fk in order if not blocks[fk].on_disk]
            if want >= used or sum(blocks[fk].nbytes for fk in victims) >= batch:
                break
            want = min(want * 2, used)
            order = self.policy.victims(want, skip)
        self.written_behind += len(victims)
        return [blocks[fk] for fk in victims]


class GpuPlacement:
    """Device slots: clean copies are dropped under plain recency; drains keep the only copy."""

    def __init__(self, table: BlockTable, pool: SlabAllocator, policy: Policy[bytes],
                 disk: DiskPlacement) -> None:
        self.table, self.pool, self.policy, self.disk = table, pool, policy, disk
        self.stats = TierCounters()

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

    def inserted(self, b: Block) -> None:
        """``b``'s device slot holds its bytes."""
        assert b.gpu_off is not None
        self.policy.on_insert(b.fk, self.pool.slot_size_at(b.gpu_off), None)

    def committed(self, b: Block) -> None:
        """A store published ``b``, new, in its device slot: bytes in."""
        self.inserted(b)
        self.stats.stored(b.nbytes)

    def served(self, b: Block) -> None:
        """A fetch found ``b`` in its device slot: a hit and a use."""
        self.stats.hit()
        self.policy.on_access(b.fk)
        b.hits += 1

    def missed(self) -> None:
        """A block a fetch asked for was not on the device."""
        self.stats.miss()

    def promoted(self, b: Block, ok: bool) -> None:
        """A copy into ``b``'s device slot finished; a failed one (its source never arrived) frees it."""
        assert b.gpu_off is not None  # set when the promotion started
        if ok:
            self.inserted(b)
            self.stats.promotions += 1
            self.stats.stored(b.nbytes)
        else:
            self.pool.free(b.gpu_off)
            b.gpu_off = None

    def drained(self, b: Block, host: HostPlacement, ok: bool) -> bool:
        """A copy of ``b`` from its device slot into host memory finished; True when it failed and the
        device copy is still the only one (drain it again)."""
        if ok:
            b.draining = False
            host.received(b)
            self.stats.demotions += 1
            return False
        host.free_failed(b)
        self.stats.failed()
        return b.draining

    def drop(self, b: Block) -> None:
        """Free a block's device slot; it stays in the colder tiers that hold it."""
        assert b.gpu_off is not None
        self.policy.on_remove(b.fk)
        self.pool.free(b.gpu_off)
        b.gpu_off = None
        self.stats.evictions += 1
        if b.host_off is None and not b.on_disk:
            self.disk.forget(b)

    def draining(self) -> bool:
        """Some block's only copy is on the device (waiting helps: its drain frees the slot's pin)."""
        return any(b.draining for b in self.table.records() if b.gpu_off is not None)

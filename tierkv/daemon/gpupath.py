"""The GPU tier's paths: commits drain from device slots into host slots (their only copy until then),
and fetches promote blocks from host or disk into device slots. Copies run on the transfer engine's
queues; records settle in their completion callbacks. Called with the store's lock held unless said."""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING

from tierkv.cache.block import Block, Session
from tierkv.cache.managers import TierManagers
from tierkv.core.errors import TierFull
from tierkv.core.keys import Namespace
from tierkv.daemon.context import Context
from tierkv.daemon.settle import completion
from tierkv.daemon.slots import Slots
from tierkv.daemon.tier_jobs import TierJobs, ready_after
from tierkv.movers.jobs import Job
from tierkv.movers.streams import Copy
from tierkv.tiers.host import slot_size_for

if TYPE_CHECKING:
    from tierkv.tiers.gpu import DevicePool


class GpuPath:
    """GPU drains (device -> host) and promotions (host -> device)."""

    def __init__(self, ctx: Context, m: TierManagers, gpu: DevicePool, slots: Slots, transfers: TierJobs) -> None:
        """The managers it sequences, the device pool it copies from and into, the slots it takes and
        the tier jobs it chains (loads from disk, writes to the remote tier, the transfer engine)."""
        self.ctx = ctx
        self.m = m
        self.table = m.table
        self.gpu = gpu
        self.slots = slots
        self.transfers = transfers
        self.engine = transfers.engine
        self.undrained: list[Block] = []  # GPU commits waiting for a host slot to drain into

    # ---- drains -----------------------------------------------------------------------------------
    def drain(self, blocks: list[Block]) -> None:
        """Copy GPU commits into host slots (the store queue; never waits for room)."""
        started: list[Block] = []
        for i, b in enumerate(blocks):
            if b.fk not in self.table or b.gpu_off is None or not b.draining or b.host_off is not None:
                continue  # deleted meanwhile, or a lease is already copying it down
            try:
                off = self.slots.host(slot_size_for(b.nbytes), wait=False)
            except TierFull:
                # host memory is full of blocks still being written back: retry when the evictor frees some
                self.undrained.extend(x for x in blocks[i:] if x.draining)
                self.ctx.kick(True)
                break
            self.m.gpu.prepare_drain(b, self.m.host, off, threading.Event())
            started.append(b)
        self.copy_to_host(started)

    def retry_drains(self) -> None:
        """Drain the GPU commits that found no host slot before (takes the lock)."""
        with self.ctx.lock:
            pending, self.undrained = self.undrained, []
            self.drain(pending)

    def copy_down(self, b: Block, off: int) -> None:
        """Copy ``b``, held only on the GPU, into host slot ``off`` (a host lease waits for it)."""
        self.m.gpu.prepare_drain(b, self.m.host, off, threading.Event())
        self.copy_to_host([b])

    def copy_to_host(self, blocks: list[Block]) -> None:
        """GPU slot -> the host slot each drain was prepared with (:meth:`GpuManager.prepare_drain`), on
        the store queue."""
        if not blocks:
            return
        copies: list[Copy] = []
        for b in blocks:
            assert b.gpu_off is not None and b.host_off is not None  # a drain with its host slot assigned
            copies.append(Copy(self.gpu.view(b.gpu_off, b.nbytes), self.engine.host_view(b.host_off, b.nbytes)))
        self.engine.submit(("gpu", "host"), copies, completion(self.ctx.changed, blocks, self._drained,
                                                               locked=functools.partial(self._write_through, blocks),
                                                               after=self._kick))

    def _drained(self, b: Block, c: Copy) -> None:
        ev, retry = self.m.gpu.complete_drain(b, self.m.host, c.ok)
        if retry:
            self.undrained.append(b)  # the GPU copy is the only one: try again later
        if ev is not None:
            ev.set()

    def _write_through(self, blocks: list[Block], _job: Job) -> None:
        self.transfers.write_through([b for b in blocks if b.host_off is not None])

    def _kick(self, _job: Job) -> None:
        self.ctx.kick()

    # ---- promotions -------------------------------------------------------------------------------
    def promote(self, s: Session, ns: Namespace, keys: list[bytes], lease: bool) -> tuple[list[Block], list[str]]:
        """Bring the cached prefix of ``keys`` into GPU slots: blocks already there at once, host blocks by
        a host -> gpu copy on the load queue, disk blocks by a disk load chained to that copy. With
        ``lease`` every block of the prefix is leased on the GPU (the caller's ticket); without, only
        copies start (prefetch). Never waits for a transfer. Takes the lock."""
        slot = slot_size_for(ns.layout.block_bytes)
        leased: list[Block] = []
        tiers: list[str] = []
        loads: list[Block] = []
        moving: list[Block] = []
        copies: list[Copy] = []
        with self.ctx.lock:
            for k in keys:
                b = self.table.get(s.fp + k)
                if b is None:
                    self.m.gpu.missed()
                    break
                if b.gpu_off is not None:
                    self.m.gpu.served(b)
                    if lease:
                        self.m.gpu.lease(b)
                        leased.append(b)
                        tiers.append("gpu")
                    continue
                source = self._source(b, slot, loads)
                if source is None:
                    break
                try:
                    goff = self.slots.gpu(slot, wait=False)
                except TierFull:
                    break  # no room on the GPU: the prefix so far is what the client gets
                self.m.gpu.missed()
                self.m.host.touch(b)
                self.m.gpu.prepare_load(b, goff, threading.Event())
                self.m.host.lease(b)  # the host slot is the copy's source: keep it until the copy is done
                moving.append(b)
                assert b.host_off is not None  # _source gave it a host slot
                copies.append(Copy(self.engine.host_view(b.host_off, b.nbytes), self.gpu.view(goff, b.nbytes),
                                   ready=None if b.loading is None else ready_after(b, b.loading)))
                if lease:
                    self.m.gpu.lease(b)
                    leased.append(b)
                    tiers.append(source)
            if loads:
                self.transfers.load(ns, loads)
        if copies:
            self._to_device(moving, copies)
        return (leased if lease else moving), tiers

    def _source(self, b: Block, slot: int, loads: list[Block]) -> str | None:
        """Where a promotion's bytes come from; a disk-only block gets a host slot to load into first.
        None: the block cannot be promoted at this point (the prefix ends)."""
        if b.host_off is not None:
            return "host" if b.loading is None else "disk"  # already coming from disk (or draining)
        if not b.on_disk:
            return None
        try:
            off = self.slots.host(slot, wait=False)
        except TierFull:
            return None
        self.transfers.prepare_load(b, off)
        loads.append(b)
        return "disk"

    def _to_device(self, moving: list[Block], copies: list[Copy]) -> None:
        self.engine.submit(("host", "gpu"), copies, completion(self.ctx.changed, moving, self._promoted))

    def _promoted(self, b: Block, c: Copy) -> None:
        self.m.host.unlease(b)
        ev = self.m.gpu.complete_load(b, c.ok)  # a failed copy (its source never arrived) is a miss, never served
        if ev is not None:
            ev.set()


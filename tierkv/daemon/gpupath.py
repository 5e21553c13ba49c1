"""The GPU tier's paths: slots and commits in device memory (each commit drains into a host slot, its
only copy until then), and fetches that promote blocks from host or disk into device slots. The copies
are tier jobs; the GPU manager settles them. Called with the store's lock held unless said."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tierkv.cache.block import Block, Session
from tierkv.cache.managers import TierManagers
from tierkv.core.errors import BadRequest, TierFull
from tierkv.core.keys import Namespace
from tierkv.daemon.commits import check_alloc, check_commit, check_slots, finish, log
from tierkv.daemon.context import Context
from tierkv.daemon.slots import Slots
from tierkv.daemon.tier_jobs import TierJobs
from tierkv.movers.streams import Copy
from tierkv.tiers.host import slot_size_for

if TYPE_CHECKING:
    from tierkv.tiers.gpu import DevicePool


class GpuPath:
    """GPU slots, commits and their drains (device -> host), and promotions (host -> device)."""

    def __init__(self, ctx: Context, m: TierManagers, gpu: DevicePool, slots: Slots, transfers: TierJobs) -> None:
        """The managers it sequences, the device pool, the slots it takes and the tier jobs it starts
        (copies both ways, loads from disk, writes to disk and to the remote tier)."""
        self.ctx = ctx
        self.m = m
        self.table = m.table
        self.gpu = gpu
        self.slots = slots
        self.transfers = transfers

    # ---- store side -------------------------------------------------------------------------------
    def alloc(self, s: Session, ns: Namespace, n: int, keys: list[bytes] | None) -> list[int | None]:
        """Device slots for ``n`` new blocks (None where ``keys[i]`` is already cached)."""
        check_alloc(n, keys)
        slot = slot_size_for(ns.layout.block_bytes)
        if slot > self.gpu.slab_bytes:
            raise BadRequest(f"a block of {ns.layout.block_bytes} bytes exceeds the GPU slab size "
                             f"({self.gpu.slab_bytes}); raise gpu.slab_bytes")
        if n * slot > self.gpu.capacity:
            raise BadRequest(f"{n} blocks of {slot} bytes exceed the GPU tier ({self.gpu.capacity} bytes)")
        with self.ctx.lock:
            return self.slots.take(s, keys, n, slot, lambda: self.slots.gpu(slot), s.gpu_slots, self.gpu.free)

    def commit(self, s: Session, ns: Namespace, keys: list[bytes], offsets: list[int], durable: bool,
               remote: bool = False, tokens: list[bytes] | None = None, uses: list[bytes] | None = None) -> int:
        """Publish device slots (as :meth:`StorePath.commit <tierkv.daemon.storepath.StorePath.commit>`);
        their copies to host memory (then disk) go on in the background."""
        check_commit(keys, offsets, durable, self.m.disk.present)
        gpum = self.m.gpu
        fks = [s.fp + k for k in keys]
        new: list[Block] = []
        committed: list[Block] = []
        remote = remote and self.transfers.remote_writable()
        with self.ctx.lock:
            check_slots(offsets, s.gpu_slots, "GPU slot")
            used = [b for k in uses or () if (b := self.table.get(s.fp + k)) is not None]
            for b in used:
                self.m.host.touch(b)
            for i, (fk, off) in enumerate(zip(fks, offsets)):
                del s.gpu_slots[off]
                b = self.table.get(fk)
                if b is None:
                    b = self.table.add(Block(fk, ns.layout.block_bytes, tokens=tokens[i] if tokens else None))
                    gpum.committed(b, off)
                    new.append(b)
                elif b.gpu_off is None and b.gpu_loading is None:
                    gpum.kept(b, off)  # cached in a colder tier: keep the fresh device copy hot
                else:
                    self.gpu.free(off)  # deduplicated
                    self.m.host.touch(b)
                committed.append(b)
            self.drain(new)
            self.ctx.notify()
        if durable or remote:
            self._after_drain([b for b in committed if not b.on_disk] if durable else [],
                              committed + used if remote else [])
        return len(new)

    def _after_drain(self, durable: list[Block], remote: list[Block]) -> None:
        """Wait for GPU commits to reach host memory, then write ``durable`` to disk (waiting for the
        sync) and ``remote`` through to the remote tier (waiting for the write), each within
        ``server.commit_wait_s``."""
        ctx = self.ctx
        deadline = time.monotonic() + ctx.cfg.server.commit_wait_s
        with ctx.lock:
            while any(b.draining for b in durable + remote):
                if not ctx.wait_until(deadline):
                    if durable:
                        raise TierFull("durable write failed: blocks did not reach host memory in time")
                    log.warning("remote commit: %d blocks did not reach host memory in time", len(remote))
                    return
            todo = [b for b in durable if not b.on_disk and b.host_ready]
            job = self.transfers.store(todo) if todo else None
            through = self.transfers.write_through(remote, every=True) if remote else []
        finish(ctx, job, through)

    def abort(self, s: Session, offsets: list[int]) -> None:
        """Give back allocated device slots without committing them."""
        with self.ctx.lock:
            for off in offsets:
                if off in s.gpu_slots:
                    del s.gpu_slots[off]
                    self.gpu.free(off)
            self.ctx.notify()

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
                self.m.gpu.undrained.extend(x for x in blocks[i:] if x.draining)
                self.ctx.kick(True)
                break
            self.transfers.prepare_drain(b, off)
            started.append(b)
        self.transfers.copy_to_host(started)

    def retry_drains(self) -> None:
        """Drain the GPU commits that found no host slot before (takes the lock)."""
        with self.ctx.lock:
            pending, self.m.gpu.undrained = self.m.gpu.undrained, []
            self.drain(pending)

    # ---- fetch side -------------------------------------------------------------------------------
    def fetch(self, s: Session, ns: Namespace, keys: list[bytes]) -> int:
        """Lease the cached prefix of ``keys`` in device slots, promoting colder blocks in the background;
        a ticket for :meth:`FetchPath.wait <tierkv.daemon.fetchpath.FetchPath.wait>`."""
        leased, tiers = self.promote(s, ns, keys, lease=True)
        with self.ctx.lock:
            self.table.count_fetch(s.fp, len(keys), len(leased))
            return self.table.open_ticket(s, leased, tiers, "gpu")

    def prefetch(self, s: Session, ns: Namespace, keys: list[bytes]) -> int:
        """Warm the cached prefix in device slots in the background; returns copies started."""
        return len(self.promote(s, ns, keys, lease=False)[0])

    def promote(self, s: Session, ns: Namespace, keys: list[bytes], lease: bool) -> tuple[list[Block], list[str]]:
        """Bring the cached prefix of ``keys`` into GPU slots: blocks already there at once, host blocks by
        a host -> gpu copy on the load queue, disk blocks by a disk load chained to that copy. With
        ``lease`` every block of the prefix is leased on the GPU (the caller's ticket); without, only
        copies start (prefetch). Never waits for a transfer. Takes the lock."""
        slot = slot_size_for(ns.layout.block_bytes)
        gpum = self.m.gpu
        leased: list[Block] = []
        tiers: list[str] = []
        loads: list[Block] = []
        moving: list[Block] = []
        copies: list[Copy] = []
        with self.ctx.lock:
            for k in keys:
                b = self.table.get(s.fp + k)
                if b is None:
                    gpum.missed()
                    break
                if b.gpu_off is not None:
                    gpum.served(b)
                    if lease:
                        gpum.lease(b)
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
                gpum.missed()
                self.m.host.touch(b)
                copies.append(self.transfers.copy_up(b, goff))
                moving.append(b)
                if lease:
                    gpum.lease(b)
                    leased.append(b)
                    tiers.append(source)
            if loads:
                self.transfers.load(ns, loads)
        self.transfers.to_device(moving, copies)
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

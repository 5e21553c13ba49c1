"""The store path: ``alloc`` hands a connection slots, the client writes them, ``commit`` publishes them
under their keys (a key already cached is deduplicated); durable commits wait for (or queue) the disk
write, remote commits for the write-through of every committed block to the remote tier. Host and
GPU tiers alike."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tierkv.cache.block import Block, Session
from tierkv.cache.managers import TierManagers
from tierkv.core.errors import BadRequest, TierFull, TierKVError
from tierkv.core.keys import Namespace
from tierkv.daemon.context import Context
from tierkv.daemon.gpupath import GpuPath
from tierkv.daemon.signals import Signals
from tierkv.daemon.slots import Slots
from tierkv.daemon.tier_jobs import TierJobs
from tierkv.movers.engine import Job
from tierkv.tiers.host import SlabAllocator, slot_size_for

log = logging.getLogger("tierkv.table")


def job_failed(job: Job) -> TierKVError | None:
    """The error of a durable write that did not reach disk in full, or None."""
    if job.error is not None or not all(m.ok for m in job.moves):
        return job.error or TierFull("durable write failed")
    return None


class StorePath:
    """Slots out, commits in."""

    def __init__(self, ctx: Context, m: TierManagers, slots: Slots, transfers: TierJobs, signals: Signals,
                 gpu_path: GpuPath | None) -> None:
        """The managers it sequences, the slots it hands out, the tier jobs it starts (disk and remote
        writes), the signals a commit feeds, and the GPU path (None: no GPU tier)."""
        self.ctx = ctx
        self.m = m
        self.table = m.table
        self.host = transfers.host
        self.hostm = m.host
        self.slots = slots
        self.transfers = transfers
        self.signals = signals
        self.disk_on = m.disk.present
        self.gpu_path = gpu_path

    # ---- alloc ------------------------------------------------------------------------------------
    def alloc(self, s: Session, ns: Namespace, n: int, keys: list[bytes] | None, tier: object,
              timeout: float | None = None, keep: list[bytes] | None = None) -> list[int | None]:
        """Slots for ``n`` new blocks (None where ``keys[i]`` is already cached: nothing to write); a
        full host tier drops blocks rather than wait for the disk writer, and waits at most ``timeout``
        seconds for blocks in use. The host blocks of ``keep`` (cached blocks the new ones continue,
        which the store skips) are held as leased while room is made: none of them is evicted for it."""
        if not isinstance(n, int) or n < 0:
            raise BadRequest("n must be a non-negative int")
        if keys is not None and len(keys) != n:
            raise BadRequest("keys and n disagree")
        slot = slot_size_for(ns.layout.block_bytes)
        if self.slots.tier(tier) == "gpu":
            return self._alloc_gpu(s, ns, n, keys, slot)
        hp = self.hostm
        if n * slot > hp.limit:
            raise BadRequest(f"{n} blocks of {slot} bytes exceed the host tier ({hp.limit} bytes)")
        with self.ctx.lock:
            held = [b for k in keep or () if (b := self.table.get(s.fp + k)) is not None and b.host_off is not None]
            for b in held:
                hp.lease(b)
            try:
                new = n if keys is None else sum(1 for k in keys if (s.fp + k) not in self.table)
                if hp.make_room(new * slot):
                    self.ctx.notify()
                return self._take_slots(s, n, keys, slot, lambda: self.slots.host(slot, timeout=timeout), s.slots,
                                        self.host.free)
            finally:
                for b in held:
                    hp.unlease(b)
                if held:
                    self.ctx.notify()  # a request waiting for an evictable block may take one of these

    def _alloc_gpu(self, s: Session, ns: Namespace, n: int, keys: list[bytes] | None, slot: int) -> list[int | None]:
        path = self.gpu_path
        assert path is not None  # slots.tier checked that the GPU tier is on
        gpu = path.gpu
        if slot > gpu.slab_bytes:
            raise BadRequest(f"a block of {ns.layout.block_bytes} bytes exceeds the GPU slab size "
                             f"({gpu.slab_bytes}); raise gpu.slab_bytes")
        if n * slot > gpu.capacity:
            raise BadRequest(f"{n} blocks of {slot} bytes exceed the GPU tier ({gpu.capacity} bytes)")
        with self.ctx.lock:
            return self._take_slots(s, n, keys, slot, lambda: self.slots.gpu(slot), s.gpu_slots, gpu.free)

    def _take_slots(self, s: Session, n: int, keys: list[bytes] | None, slot: int, take: Callable[[], int],
                    owned: dict[int, int], free: Callable[[int], None]) -> list[int | None]:
        """Slots from ``take`` for the blocks not cached yet (None for cached keys), recorded in the
        connection's ``owned``; all given back if the tier fills on the way. Lock held."""
        out: list[int | None] = []
        try:
            for i in range(n):
                if keys is not None and (s.fp + keys[i]) in self.table:
                    out.append(None)
                    continue
                off = take()
                owned[off] = slot
                out.append(off)
        except TierFull:
            for given in out:
                if given is not None:
                    owned.pop(given, None)
                    free(given)
            raise
        return out

    # ---- commit -----------------------------------------------------------------------------------
    def commit(self, s: Session, ns: Namespace, keys: list[bytes], offsets: list[int], durable: bool, tier: object,
               wait: bool, chains: dict[int, bytes | None] | None, remote: bool,
               tokens: list[bytes] | None, uses: list[bytes] | None = None) -> int:
        """Publish written slots of ``tier`` under ``keys``; returns how many were new (the rest
        deduplicated). ``keys`` are prefix chains, each key the child of the one before except at the
        indexes of ``chains``, where a chain continues the key given (None: starts one; default
        ``{0: None}``). ``durable`` with ``wait=False`` (host tier): return once the disk write is
        queued; :meth:`sync` waits for it (a client streams a large durable put: its next copy overlaps
        this write). ``remote``: every block is written through, admitted or not, before the return
        (if writable). ``tokens``: each block's token ids (int32), kept for KV events when they are on.
        ``uses``: cached blocks the client skipped rather than write again; each still cached counts as
        a use, as a deduplicated block does, before the new blocks are published."""
        if len(keys) != len(offsets):
            raise BadRequest("keys and slots differ in length")
        if durable and not self.disk_on:
            raise BadRequest("durable=True needs the disk tier, which is disabled")
        if self.slots.tier(tier) == "gpu":
            return self.commit_gpu(s, ns, keys, offsets, durable, remote, tokens, uses)
        return self._commit_host(s, ns, keys, offsets, durable, wait, chains or {0: None}, remote, tokens, uses)

    def _use(self, s: Session, uses: list[bytes] | None) -> list[Block]:
        """Count a use of each cached block of ``uses`` (one gone since is a later miss); returns the
        blocks found. Lock held."""
        found = [b for k in uses or () if (b := self.table.get(s.fp + k)) is not None]
        for b in found:
            self.hostm.touch(b)
        return found

    def _commit_host(self, s: Session, ns: Namespace, keys: list[bytes], offsets: list[int], durable: bool,
                     wait: bool, chains: dict[int, bytes | None], remote: bool,
                     tokens: list[bytes] | None, uses: list[bytes] | None) -> int:
        """Publish written host slots under ``keys``, prefix chains starting at the indexes of ``chains``."""
        fks = [s.fp + k for k in keys]
        remote = remote and self.remote_writable()
        with self.ctx.lock:
            _check_slots(offsets, s.slots, "slot")
            used = self._use(s, uses)
            starts = {i: None if p is None else s.fp + p for i, p in chains.items()}
            new, committed = self._publish_host(s, ns, fks, offsets, starts, tokens)
            self.signals.computed(new)
            # the producer side of PD across nodes: the prefix its blocks continue, and the cached blocks
            # it skipped, go to the remote too (each block once)
            through = self.transfers.write_through(
                list({b.fk: b for b in committed + used + self._ancestors(starts)}.values()) if remote else new,
                every=remote)
            self.signals.stored(fks, starts)
            durable_blocks = [b for b in committed if not b.on_disk] if durable else []
            job = self.transfers.store(durable_blocks) if durable_blocks else None
            if job is not None and not wait:
                s.pending.append(job)
                job = None
            self.ctx.notify()
        self._finish(job, through)
        self.ctx.kick()
        return len(new)

    def _publish_host(self, s: Session, ns: Namespace, fks: list[bytes], offsets: list[int],
                      starts: dict[int, bytes | None],
                      tokens: list[bytes] | None) -> tuple[list[Block], list[Block]]:
        """Records for committed host slots, chains starting at ``starts`` (index: parent): (new
        blocks, every committed block). Lock held."""
        table, hp = self.table, self.hostm
        new: list[Block] = []
        committed: list[Block] = []
        parent: bytes | None = None
        for i, (fk, off) in enumerate(zip(fks, offsets)):
            if i in starts:
                parent = starts[i]
            del s.slots[off]
            b = table.get(fk)
            if b is None:
                b = table.add(Block(fk, ns.layout.block_bytes, parent, tokens[i] if tokens else None))
                hp.committed(b, off, parent)
                new.append(b)
            elif b.host_off is None and b.loading is None:
                hp.kept(b, off, parent, tokens[i] if tokens else None)  # on disk only: no read back
            else:
                self.host.free(off)  # deduplicated
                hp.touch(b)
            committed.append(b)
            parent = fk
        return new, committed

    def commit_gpu(self, s: Session, ns: Namespace, keys: list[bytes], offsets: list[int], durable: bool,
                   remote: bool = False, tokens: list[bytes] | None = None, uses: list[bytes] | None = None) -> int:
        """Publish GPU slots; their copies to host memory (then disk) go on in the background."""
        path = self.gpu_path
        assert path is not None  # the caller's slots.tier checked that the GPU tier is on
        gpum = self.m.gpu
        fks = [s.fp + k for k in keys]
        new: list[Block] = []
        committed: list[Block] = []
        remote = remote and self.remote_writable()
        with self.ctx.lock:
            _check_slots(offsets, s.gpu_slots, "GPU slot")
            used = self._use(s, uses)
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
                    path.gpu.free(off)  # deduplicated
                    self.hostm.touch(b)
                committed.append(b)
            path.drain(new)
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
        self._finish(job, through)

    def _finish(self, job: Job | None, through: list[Job]) -> None:
        """Wait for a commit's disk write ``job`` and its remote writes ``through``.

        Raises:
            TierKVError: the disk write failed (a failed remote write is logged and counted only:
                the block is a recompute, the commit stands).
        """
        if job is not None:
            job.wait()
        if through:
            self._wait_remote(through)
        err = job_failed(job) if job is not None else None
        if err is not None:
            raise err

    def _wait_remote(self, jobs: list[Job]) -> None:
        """Wait (at most ``server.commit_wait_s``) for the remote writes of a commit; log what did not land."""
        deadline = time.monotonic() + self.ctx.cfg.server.commit_wait_s
        late = sum(not j.wait(max(0.0, deadline - time.monotonic())) for j in jobs)
        lost = sum(1 for j in jobs if j.done.is_set() for m in j.moves if not m.ok)
        if late or lost:
            log.warning("remote commit: %d blocks of its write-through jobs not written, %d jobs still running",
                        lost, late)

    def _ancestors(self, starts: dict[int, bytes | None], limit: int = 1 << 14) -> list[Block]:
        """The blocks the chains of a commit continue (parents' parents, up to ``limit``) that are not
        on the remote tier: a prefix the engine loaded rather than computed. Lock held."""
        out: list[Block] = []
        for parent in starts.values():
            b = self.table.get(parent) if parent is not None else None
            while b is not None and not b.on_remote and len(out) < limit:
                out.append(b)
                b = self.table.get(b.parent) if b.parent is not None else None
        return out

    def remote_writable(self) -> bool:
        """Whether a commit's write-through can be waited for: a remote tier whose breakers let writes
        through (otherwise the write would be dropped at once: the commit does not wait for it)."""
        return self.transfers.remote_writable()

    # ---- sync and abort ---------------------------------------------------------------------------
    def sync(self, s: Session) -> None:
        """Wait for the durable writes this connection committed with ``wait=False``.

        Raises:
            TierKVError: one of them failed (the first error); every one was waited for.
        """
        with self.ctx.lock:
            jobs, s.pending = s.pending, []
        failed: TierKVError | None = None
        for job in jobs:
            job.wait()
            if failed is None:
                failed = job_failed(job)
        if failed is not None:
            raise failed

    def abort(self, s: Session, offsets: list[int], gpu: bool) -> None:
        """Give back allocated slots without committing them."""
        pool: SlabAllocator
        if gpu:
            assert self.gpu_path is not None  # the caller's slots.tier checked that the GPU tier is on
            pool, mine = self.gpu_path.gpu, s.gpu_slots
        else:
            pool, mine = self.host, s.slots
        with self.ctx.lock:
            for off in offsets:
                if off in mine:
                    del mine[off]
                    pool.free(off)
            self.ctx.notify()


def _check_slots(offsets: list[int], owned: dict[int, int], what: str) -> None:
    for off in offsets:
        if not isinstance(off, int) or off not in owned:
            raise BadRequest(f"{what} {off!r} was not allocated by this connection")
    if len(set(offsets)) != len(offsets):
        raise BadRequest("a slot appears twice")

"""The tier jobs the store starts between host memory and the colder tiers: write-back to disk (with
the room the disk placement made for it), write-through to the remote tier, loads from disk or the
remote tier into host slots, and the disk's verify scan.

Each asks the managers of the tiers involved to prepare the transfer, submits a transfer-engine job by
route, and completes it through the same managers in the job's completion callback (a slot a transfer
reads or fills stays until then). The measured rates of loads feed the store's cost model. Called with
the store's lock held unless said.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable

from tierkv.cache.block import Block, LoadSignal
from tierkv.cache.costmodel import CostModel
from tierkv.cache.managers import TierManagers
from tierkv.core.errors import TierFull
from tierkv.core.keys import Namespace
from tierkv.daemon.context import Context
from tierkv.daemon.settle import completion, moves
from tierkv.daemon.startup import Tiers
from tierkv.movers.engine import VERIFY, Job, Move, TransferEngine
from tierkv.movers.jobs import failed_job
from tierkv.movers.streams import Copy

log = logging.getLogger("tierkv.table")
TO_DISK = ("host", "disk")


class TierJobs:
    """Starts the store's host <-> disk, host <-> remote and disk verify jobs, and settles them."""

    def __init__(self, ctx: Context, m: TierManagers, tiers: Tiers, engine: TransferEngine,
                 cost: CostModel) -> None:
        """The managers the jobs are prepared and completed through, the tiers they run on, the engine
        that runs them and the cost model their measured rates feed."""
        self.ctx, self.m, self.engine, self.cost = ctx, m, engine, cost
        self.tiers = tiers
        self.host, self.disk, self.remote = tiers.host, tiers.disk, tiers.remote
        self._inflight: dict[bytes, Job] = {}  # remote writes not finished yet, by block

    def _moves(self, blocks: list[Block]) -> list[Move]:
        return moves(blocks, self.host.view, self.m.table.layout_of)

    # ---- host -> disk -----------------------------------------------------------------------------
    def store(self, blocks: list[Block], background: bool = False, bounded: bool = False) -> Job:
        """Queue host -> disk writes of dirty blocks (their slots stay pinned until done), with the
        deletes that make room for them; without blocks, only the deletes (the disk shrinks to its
        watermark). A disk with nothing to drop fails the job at once (``TierFull``). ``background``:
        no request waits for it (write-behind, demotions); it gives way to a write queued behind it that
        is not background, and the blocks it did not write stay dirty. ``bounded`` (and ``background``):
        within the CPU share of ``disk.background_share`` while the engine keeps the cores busy."""
        diskm = self.m.disk
        try:
            deletes, reserved = diskm.prepare_store(blocks)
        except TierFull as exc:
            diskm.write_refused()
            return failed_job(TO_DISK, self._moves(blocks), exc)
        self.m.host.prepare_write(blocks)
        # the evictor may be waiting on this write (demotion, write-behind): it wakes once it settled
        done = completion(self.ctx.changed, blocks, self._stored,
                          locked=functools.partial(self._store_settled, reserved), after=self._wake_evictor)
        return self.engine.submit(TO_DISK, self._moves(blocks), on_done=done, deletes=deletes, background=background,
                                  bounded=bounded)

    def _stored(self, b: Block, m: Move) -> None:
        self.m.host.complete_write(b)
        if m.ok:  # written, even when a later batch failed
            self.m.disk.complete_store(b, m.stored_bytes)

    def _store_settled(self, reserved: int, job: Job) -> None:
        self.m.disk.store_settled(reserved, failed=job.error is not None)
        if job.error is not None and not job.full:
            self.ctx.degraded = str(job.error)

    def _wake_evictor(self, _job: Job) -> None:
        self.ctx.wakeup.set()

    def trim_disk(self) -> None:
        """Drop disk blocks down to the low watermark when above the high one (takes the lock)."""
        with self.ctx.lock:
            self.store([])

    def verify(self, drop: bool = False) -> dict:
        """Decode every disk value on the movers (header, sizes, checksum); report bad ones and, with
        ``drop``, forget and delete them. Takes the lock."""
        if self.disk is None:
            return {"checked": 0, "bad": [], "dropped": 0}
        job = self.engine.submit(VERIFY, [])
        job.wait()
        if job.error is not None:
            raise job.error
        bad = [{"key": lk.hex(), "error": why} for lk, why in job.bad]
        dropped = 0
        if drop and job.bad:
            keys = [lk for lk, _ in job.bad]
            with self.ctx.lock:
                diskm = self.m.disk
                for fk in keys:
                    b = self.m.table.get(fk)
                    if b is not None and not b.protected:
                        if b.on_disk:
                            diskm.removed(b)
                        if b.host_off is None and b.gpu_off is None:
                            diskm.forget(b)
                diskm.corrupt_dropped(len(keys))
                delete = self.engine.submit(TO_DISK, [], deletes=keys)
            delete.wait()
            if delete.error is not None:
                raise delete.error
            dropped = len(keys)
        return {"checked": job.checked, "bad": bad, "dropped": dropped}

    # ---- host -> remote ---------------------------------------------------------------------------
    def write_through(self, blocks: list[Block], every: bool = False) -> list[Job]:
        """Copy host blocks to the remote tier in the background (slots pinned meanwhile): those
        ``remote.admission`` admits, or with ``every`` all of them.

        Returns:
            With ``every``, the jobs writing any of ``blocks`` (this call's and those already in
            flight), for a caller that waits until they are on the remote; otherwise an empty list.
        """
        if self.remote is None:
            return []
        mode = self.ctx.cfg.remote.admission
        m = self.m
        todo = [b for b in blocks if not b.on_remote and b.host_ready and (every or m.host.worth_writing(b, mode))]
        jobs = {id(j): j for j in (self._inflight.get(b.fk) for b in blocks) if j is not None} if every else {}
        if not todo:
            return list(jobs.values())
        m.host.prepare_write(todo)
        m.remote.prepare_store(todo)  # counted as there at once: a failed write takes it back
        job = self.engine.submit(("host", "remote"), self._moves(todo),
                                 on_done=completion(self.ctx.changed, todo, self._written_through))
        if not job.done.is_set():  # its completion, which forgets it, waits for the lock the caller holds
            self._inflight.update(dict.fromkeys((b.fk for b in todo), job))
        if every:
            jobs[id(job)] = job
        return list(jobs.values())

    def _written_through(self, b: Block, m: Move) -> None:
        self.m.host.complete_write(b)
        self._inflight.pop(b.fk, None)
        self.m.remote.complete_store(b, m.ok)

    def remote_writable(self) -> bool:
        """Whether a write-through can be waited for: a remote tier whose breakers let writes through."""
        return self.remote is not None and self.remote.writable()

    # ---- disk -> host -----------------------------------------------------------------------------
    def load(self, ns: Namespace, blocks: list[Block]) -> Job:
        """Read disk values into the host slots ``blocks`` were given (:meth:`prepare_load`)."""
        bad: list[bytes] = []
        moves_ = moves(blocks, self.host.view, lambda _b: ns.layout)
        done = completion(self.ctx.changed, blocks, functools.partial(self._loaded, bad), locked=self._observe("disk"),
                          after=functools.partial(self._delete_bad, bad))
        return self.engine.submit(("disk", "host"), moves_, on_done=done)

    def _loaded(self, bad: list[bytes], b: Block, m: Move) -> None:
        """A disk value reached ``b``'s host slot, or did not: a bad value is a miss, dropped everywhere
        and never served."""
        diskm = self.m.disk
        if not m.ok:
            if diskm.read_failed(m.error):
                bad.append(b.fk)
            else:
                self.ctx.degraded = m.error
        ev = self.m.host.complete_load(b, m.ok, diskm.stats, promotion=True)
        if ev is not None:
            ev.set()

    def _delete_bad(self, bad: list[bytes], _job: Job) -> None:
        if bad and self.disk is not None:
            try:
                self.disk.delete(bad)
            except Exception as exc:  # the records are gone already; a stale value is re-verified anyway
                log.warning("could not delete corrupt values: %s", exc)

    def prepare_load(self, b: Block, off: int) -> None:
        """``b`` gets host slot ``off`` to load into (its read starts in a job of :meth:`load` or
        :meth:`load_remote`)."""
        self.m.host.prepare_load(b, off, threading.Event())

    # ---- remote -> host ---------------------------------------------------------------------------
    def load_remote(self, blocks: list[Block]) -> None:
        """Fetch blocks from the remote tier into their host slots (records made, loads prepared)."""
        done = completion(self.ctx.changed, blocks, self._loaded_remote, locked=self._observe("remote"))
        self.engine.submit(("remote", "host"), self._moves(blocks), on_done=done)

    def _loaded_remote(self, b: Block, m: Move) -> None:
        """A remote value reached ``b``'s host slot, or did not (gone, corrupt or the remote is down: a
        miss, never served)."""
        ev = self.m.host.complete_load(b, m.ok, self.m.remote.stats)
        if ev is not None:
            ev.set()

    # ---- gpu <-> host ------------------------------------------------------------------------------
    def prepare_drain(self, b: Block, off: int) -> None:
        """``b``'s device copy is to be copied into host slot ``off`` (by :meth:`copy_to_host`)."""
        self.m.gpu.prepare_drain(b, self.m.host, off, threading.Event())

    def copy_down(self, b: Block, off: int) -> None:
        """Copy ``b``, held only on the GPU, into host slot ``off`` (a host lease waits for it)."""
        self.prepare_drain(b, off)
        self.copy_to_host([b])

    def copy_to_host(self, blocks: list[Block]) -> None:
        """GPU slot -> the host slot each drain was prepared with (:meth:`GpuManager.prepare_drain`), on
        the store queue; the blocks that arrived are written through to the remote tier."""
        if not blocks:
            return
        gpu = self.tiers.gpu
        assert gpu is not None  # the blocks hold GPU slots
        copies = []
        for b in blocks:
            assert b.gpu_off is not None and b.host_off is not None  # a drain with its host slot assigned
            copies.append(Copy(gpu.view(b.gpu_off, b.nbytes), self.engine.host_view(b.host_off, b.nbytes)))
        self.engine.submit(("gpu", "host"), copies, completion(self.ctx.changed, blocks, self._drained,
                                                               locked=functools.partial(self._arrived, blocks),
                                                               after=self._kick))

    def _drained(self, b: Block, c: Copy) -> None:
        ev = self.m.gpu.complete_drain(b, self.m.host, c.ok)
        if ev is not None:
            ev.set()

    def _arrived(self, blocks: list[Block], _job: Job) -> None:
        self.write_through([b for b in blocks if b.host_off is not None])

    def _kick(self, _job: Job) -> None:
        self.ctx.kick()

    def copy_up(self, b: Block, off: int) -> Copy:
        """Start filling device slot ``off`` from ``b``'s host slot (read until the copy is done, after
        the load filling it, if any): the copy, for :meth:`to_device`."""
        gpu = self.tiers.gpu
        assert gpu is not None and b.host_off is not None  # a promotion: GPU tier on, a host slot to read
        self.m.gpu.prepare_load(b, off, threading.Event())
        self.m.host.lease(b)
        return Copy(self.engine.host_view(b.host_off, b.nbytes), gpu.view(off, b.nbytes),
                    ready=None if b.loading is None else ready_after(b, b.loading))

    def to_device(self, blocks: list[Block], copies: list[Copy]) -> None:
        """Run the host -> GPU copies of :meth:`copy_up` on the load queue."""
        if copies:
            self.engine.submit(("host", "gpu"), copies, completion(self.ctx.changed, blocks, self._promoted))

    def _promoted(self, b: Block, c: Copy) -> None:
        self.m.host.unlease(b)
        ev = self.m.gpu.complete_load(b, c.ok)  # a failed copy (its source never arrived) is a miss, never served
        if ev is not None:
            ev.set()

    def _observe(self, tier: str) -> Callable[[Job], None]:
        """A load's settle step that feeds its measured rate to the store's cost model."""
        def observe(job: Job) -> None:
            got = sum(m.view.nbytes for m in job.moves if m.ok)
            if got:
                self.cost.observe(tier, got, job.seconds)
        return observe


def ready_after(b: Block, ev: LoadSignal | None) -> Callable[[], bool]:
    """For a copy out of ``b``'s host slot: wait until a load into that slot finished; False if it failed."""
    def ready() -> bool:
        if ev is not None:
            ev.wait(120.0)
        return not b.load_failed and b.host_off is not None and b.loading is None
    return ready

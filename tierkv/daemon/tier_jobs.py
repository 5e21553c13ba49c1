"""The tier jobs the store starts between host memory and the colder tiers: write-back to disk (with
the room the disk placement made for it), write-through to the remote tier, loads from disk or the
remote tier into host slots, and the disk's verify scan.

Each submits a transfer-engine job by route and settles the records in its completion callback through
the placement of the tier the blocks arrived in; a slot a transfer reads or fills is pinned
(``writing``, ``loading``) until then. The measured rates of loads feed the store's cost model. Called
with the store's lock held unless said.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tierkv.cache.block import Block, LoadSignal
from tierkv.cache.costmodel import CostModel
from tierkv.cache.counters import TierCounters
from tierkv.cache.placement import DiskPlacement, HostPlacement
from tierkv.cache.table import BlockTable
from tierkv.core.errors import TierFull
from tierkv.core.keys import Namespace
from tierkv.daemon.context import Context
from tierkv.daemon.settle import completion, moves, settle
from tierkv.movers.engine import VERIFY, Job, Move, TransferEngine
from tierkv.movers.jobs import failed_job
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.host import HostPool

if TYPE_CHECKING:
    from tierkv.tiers.remote import RemoteTier  # loads redis: the daemon imports it only with a remote tier

log = logging.getLogger("tierkv.table")
TO_DISK = ("host", "disk")


class TierJobs:
    """Starts the store's host <-> disk, host <-> remote and disk verify jobs, and settles them."""

    def __init__(self, ctx: Context, table: BlockTable, host: HostPool, hostp: HostPlacement, diskp: DiskPlacement,
                 engine: TransferEngine, cost: CostModel, disk: DiskTier | None, remote: RemoteTier | None,
                 remote_counters: TierCounters, written: Callable[[], None]) -> None:
        """The objects the jobs start on and settle through.

        Args:
            remote_counters: the remote tier's figures (it has no placement).
            written: runs after every disk write settled, outside the lock (it wakes the evictor, which
                may wait on the write).
        """
        self.ctx, self.table, self.host, self.hostp, self.diskp = ctx, table, host, hostp, diskp
        self.engine, self.cost, self.disk, self.remote = engine, cost, disk, remote
        self.remote_counters, self.written = remote_counters, written
        self._inflight: dict[bytes, Job] = {}  # remote writes not finished yet, by block

    def _moves(self, blocks: list[Block]) -> list[Move]:
        return moves(blocks, self.host.view, self.table.layout_of)

    # ---- host -> disk -----------------------------------------------------------------------------
    def store(self, blocks: list[Block], background: bool = False, bounded: bool = False) -> Job:
        """Queue host -> disk writes of dirty blocks (their slots stay pinned until done), with the
        deletes that make room for them; without blocks, only the deletes (the disk shrinks to its
        watermark). A disk with nothing to drop fails the job at once (``TierFull``). ``background``:
        no request waits for it (write-behind, demotions); it gives way to a write queued behind it that
        is not background, and the blocks it did not write stay dirty. ``bounded`` (and ``background``):
        within the CPU share of ``disk.background_share`` while the engine keeps the cores busy."""
        ctx, diskp = self.ctx, self.diskp
        try:
            deletes, reserved = diskp.room_for_write(blocks)
        except TierFull as exc:
            diskp.write_refused()
            return failed_job(TO_DISK, self._moves(blocks), exc)
        for b in blocks:
            b.writing += 1

        def each(b: Block, m: Move) -> None:
            b.writing -= 1
            if m.ok:  # written, even when a later batch failed
                diskp.written(b, m.stored_bytes)

        def settled(job: Job) -> None:
            diskp.write_settled(reserved, failed=job.error is not None)
            if job.error is not None and not job.full:
                ctx.degraded = str(job.error)

        # the evictor may be waiting on this write (demotion, write-behind)
        done = completion(ctx.changed, blocks, each, locked=settled, after=lambda _job: self.written())
        return self.engine.submit(TO_DISK, self._moves(blocks), on_done=done, deletes=deletes, background=background,
                                  bounded=bounded)

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
                for fk in keys:
                    b = self.table.get(fk)
                    if b is not None and not b.protected:
                        if b.on_disk:
                            self.diskp.removed(b)
                        if b.host_off is None and b.gpu_off is None:
                            self.diskp.forget(b)
                self.diskp.corrupt_dropped(len(keys))
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
        todo = [b for b in blocks if not b.on_remote and b.host_ready and (every or self.hostp.worth_writing(b, mode))]
        jobs = {id(j): j for j in (self._inflight.get(b.fk) for b in blocks) if j is not None} if every else {}
        if not todo:
            return list(jobs.values())
        for b in todo:
            b.writing += 1
            b.on_remote = True  # optimistic: a failed write is undone below

        def each(b: Block, m: Move) -> None:
            b.writing -= 1
            self._inflight.pop(b.fk, None)
            if m.ok:
                self.remote_counters.stored(b.nbytes)
            else:
                b.on_remote = False

        job = self.engine.submit(("host", "remote"), self._moves(todo), on_done=completion(self.ctx.changed, todo, each))
        if not job.done.is_set():  # its completion, which forgets it, waits for the lock the caller holds
            self._inflight.update(dict.fromkeys((b.fk for b in todo), job))
        if every:
            jobs[id(job)] = job
        return list(jobs.values())

    # ---- disk -> host -----------------------------------------------------------------------------
    def load(self, ns: Namespace, blocks: list[Block]) -> Job:
        """Read disk values into the host slots already assigned to ``blocks`` (``loading`` set)."""
        hostp, diskp = self.hostp, self.diskp
        bad: list[bytes] = []

        def each(b: Block, m: Move) -> None:
            ev = settle(b)
            if m.ok:
                hostp.loaded(b, diskp.stats, promotion=True)
            else:  # a bad value is a miss: drop the entry everywhere, never serve it
                hostp.load_failed(b, diskp.stats)
                if diskp.read_failed(m.error):
                    bad.append(b.fk)
                else:
                    self.ctx.degraded = m.error
            if ev is not None:
                ev.set()

        def delete_bad(_job: Job) -> None:
            if bad and self.disk is not None:
                try:
                    self.disk.delete(bad)
                except Exception as exc:  # the records are gone already; a stale value is re-verified anyway
                    log.warning("could not delete corrupt values: %s", exc)

        moves_ = moves(blocks, self.host.view, lambda _b: ns.layout)
        done = completion(self.ctx.changed, blocks, each, locked=self._observe("disk"), after=delete_bad)
        return self.engine.submit(("disk", "host"), moves_, on_done=done)

    def start_loads(self, blocks: list[Block]) -> None:
        """Mark blocks whose host slot was just assigned as loading (their reads start in one job)."""
        for b in blocks:
            b.loading = threading.Event()
            b.load_failed = False

    # ---- remote -> host ---------------------------------------------------------------------------
    def load_remote(self, blocks: list[Block]) -> None:
        """Fetch blocks from the remote tier into their host slots (records made, ``loading`` set)."""
        hostp, counters = self.hostp, self.remote_counters

        def each(b: Block, m: Move) -> None:
            ev = settle(b)
            if m.ok:
                hostp.loaded(b, counters)
            else:  # a miss (gone, corrupt or the remote is down): never served
                hostp.load_failed(b, counters)
            if ev is not None:
                ev.set()

        done = completion(self.ctx.changed, blocks, each, locked=self._observe("remote"))
        self.engine.submit(("remote", "host"), self._moves(blocks), on_done=done)

    def _observe(self, tier: str) -> Any:
        """A load's settle step that feeds its measured rate to the store's cost model."""
        def observe(job: Job) -> None:
            got = sum(m.view.nbytes for m in job.moves if m.ok)
            if got:
                self.cost.observe(tier, got, job.seconds)
        return observe


def ready_after(b: Block, ev: LoadSignal | None) -> Any:
    """For a copy out of ``b``'s host slot: wait until a load into that slot finished; False if it failed."""
    def ready() -> bool:
        if ev is not None:
            ev.wait(120.0)
        return not b.load_failed and b.host_off is not None and b.loading is None
    return ready

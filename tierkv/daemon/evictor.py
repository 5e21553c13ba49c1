"""The evictor: a daemon thread that demotes host blocks between the watermarks, retries GPU drains
that found no host slot, and writes cold dirty blocks behind while the disk writer is idle; and the
shutdown flush, which writes every dirty host block to disk."""

from __future__ import annotations

import logging
import threading
import time

from tierkv.cache.managers import TierManagers
from tierkv.daemon.busy_cores import BusyCores
from tierkv.daemon.context import Context
from tierkv.daemon.gpupath import GpuPath
from tierkv.daemon.tier_jobs import TierJobs
from tierkv.movers.engine import Job

log = logging.getLogger("tierkv.table")

# A write-behind batch takes at most this share of the host tier: the blocks it holds are pinned until
# written, and the rest of the tier must keep blocks a store can drop when the writer falls behind.
WRITE_BEHIND_SHARE = 1 / 8
# A write-behind batch writes at most this much: short, so that the next one asks again whether the
# engine leaves cores idle (the writer's copies into the page cache run in the kernel, where an engine
# thread that wakes waits for them).
WRITE_BEHIND_BATCH_BYTES = 16 << 20
# While the engine keeps the cores busy and stores drop blocks not written yet (the tier would never be
# written otherwise), write-behind still starts a batch this often.
WRITE_BEHIND_BUSY_EVERY_S = 1.0


class Evictor:
    """Runs when kicked (a store filled the tier, a write finished) and every half second."""

    def __init__(self, ctx: Context, m: TierManagers, transfers: TierJobs, drains: GpuPath | None) -> None:
        """It runs soon whenever ``ctx.wakeup`` is set: by :meth:`Context.kick`, and by every disk write
        that settles (demotion and write-behind wait on them). ``drains``: the GPU path (None: no GPU tier)."""
        self.ctx = ctx
        self.m = m
        self.table = m.table
        self.outflow = m.outflow
        self.transfers = transfers
        self.engine = transfers.engine
        self.disk_on = m.disk.present
        self.drains = drains
        self._wb_job: Job | None = None  # the write-behind batch in flight
        self._busy = BusyCores()
        self._dropped_seen = 0  # the host tier's dropped_unwritten when the last batch started
        self._busy_batch_at = 0.0  # when the last batch started while the engine was busy
        self._thread = threading.Thread(target=self._loop, name="tierkv-evictor", daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (the store is closing)."""
        self.ctx.wakeup.set()
        self._thread.join(5)

    def _loop(self) -> None:
        while not self.ctx.closing:
            self.ctx.wakeup.wait(0.5)
            self.ctx.wakeup.clear()
            try:
                self._demote_once()
                if self.drains is not None and self.m.gpu.undrained:
                    self.drains.retry_drains()
                self._write_behind()
            except Exception:
                log.exception("evictor")

    def _demote_once(self) -> None:
        """Write dirty victims back, then free their slots (clean victims are dropped at once)."""
        ctx = self.ctx
        with ctx.lock:
            force, asked = ctx.take_kicks()
            dirty = self.outflow.demotion(force)
            ctx.notify()
            job = self.transfers.store(dirty, background=ctx.cfg.disk.demote_idle, bounded=True) if dirty else None
        waited = ctx.synchronous and ctx.passes < asked  # a synchronous store waits for this pass
        if job is None and not waited:
            return
        if job is not None:
            job.wait()
        with ctx.lock:
            if job is not None:
                self.outflow.demoted(dirty)
            if ctx.synchronous:
                ctx.passes = max(ctx.passes, asked)
            ctx.notify()

    def _write_behind(self) -> None:
        """Clean the coldest admitted dirty host blocks while the disk writer is idle: a later eviction
        then only frees their slots, so a burst of stores runs at memory speed instead of disk speed."""
        if not self.disk_on or not self.ctx.cfg.host.write_behind or self.ctx.closing:
            return
        cores = self.ctx.cfg.host.write_behind_idle_cores
        busy = cores > 0 and not self._busy.idle(cores)  # read every pass: the window stays recent
        if self._wb_job is not None and not self._wb_job.done.is_set():
            return  # one batch at a time; its completion wakes the evictor for the next
        if not self.outflow.write_behind_due():
            return
        dropped, now = self.m.host.stats.dropped_unwritten, time.monotonic()
        if busy:
            if dropped == self._dropped_seen or now - self._busy_batch_at < WRITE_BEHIND_BUSY_EVERY_S:
                self.outflow.write_behind_waits += 1  # a batch deferred: asked again within half a second
                return
            self._busy_batch_at = now  # stores are losing blocks: a paced batch all the same
        self._dropped_seen = dropped
        with self.ctx.lock:
            batch = min(self.engine.writes.batch_bytes, WRITE_BEHIND_BATCH_BYTES,
                        int(self.m.host.limit * WRITE_BEHIND_SHARE))
            victims = self.outflow.write_behind_batch(batch)
            if victims:  # a paced batch encodes at ``disk.write_nice``: the idle class gets no core now
                self._wb_job = self.transfers.store(victims, background=not busy)

    def flush(self, timeout: float) -> int:
        """Write every dirty host block to disk within ``timeout`` seconds (a warm next start); GPU
        commits first reach host memory (their drains). Returns blocks written."""
        if not self.disk_on:
            return 0
        ctx = self.ctx
        deadline = time.monotonic() + timeout
        with ctx.lock:
            if self.drains is not None:
                self.drains.retry_drains()
            while any(b.draining for b in self.table.records()) and ctx.wait_until(deadline):
                pass
            dirty = [b for b in self.table.records() if b.host_ready and not b.on_disk and not b.writing]
            batch = ctx.cfg.disk.write_batch
            # pinned blocks in batches of their own, first: a batch the disk cannot make room for fails
            # whole, and a pinned block left unwritten is not pinned again at the next start
            pinned, rest = [b for b in dirty if b.pin], [b for b in dirty if not b.pin]
            jobs = [self.transfers.store(part[i:i + batch]) for part in (pinned, rest)
                    for i in range(0, len(part), batch)]
        for j in jobs:
            j.wait(max(0.0, deadline - time.monotonic()))
        return sum(1 for j in jobs if j.done.is_set() and j.error is None for m in j.moves if m.ok)

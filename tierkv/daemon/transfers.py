"""The transfers between host memory and the colder tiers that the store starts: write-back to disk,
write-through to the remote tier, and loads from disk or the remote tier into host slots.

Each starts a transfer-engine job and settles the records in its completion callback; a slot a
transfer reads or fills is pinned (``writing``, ``loading``) until then. Called with the store's lock
held.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from tierkv.cache.block import Block
from tierkv.core.keys import Namespace
from tierkv.daemon.jobs import completion, moves, settle
from tierkv.daemon.parts import TransferParts
from tierkv.movers.transfer import Job, Move

log = logging.getLogger("tierkv.table")


class Transfers:
    """Starts the store's host <-> disk and host <-> remote jobs."""

    def __init__(self, st: TransferParts) -> None:
        self.st = st
        self._inflight: dict[bytes, Job] = {}  # remote writes not finished yet, by block

    def _moves(self, blocks: list[Block]) -> list[Move]:
        return moves(blocks, self.st.host.view, self.st.table.layout_of)

    # ---- host -> disk -----------------------------------------------------------------------------
    def store(self, blocks: list[Block]) -> Job:
        """Queue host -> disk writes of dirty blocks (their slots stay pinned until done)."""
        st = self.st
        for b in blocks:
            b.writing += 1

        def each(b: Block, m: Move) -> None:
            b.writing -= 1
            if m.ok and not b.on_disk and b.fk in st.table:  # written, even when a later batch failed
                b.on_disk = True
                b.disk_bytes = m.stored_bytes
                st.diskp.added(b)
                st.diskp.stats.bytes_in += b.nbytes

        def failed(job: Job) -> None:
            if job.error is not None:
                st.diskp.stats.errors += 1
                if "full" not in str(job.error):
                    st.degraded = str(job.error)

        # the evictor may be waiting on this write (demotion, write-behind)
        done = completion(st.changed, blocks, each, locked=failed, after=lambda _job: st.evictor.wake())
        return st.engine.store(self._moves(blocks), on_done=done)

    # ---- host -> remote ---------------------------------------------------------------------------
    def write_through(self, blocks: list[Block], every: bool = False) -> list[Job]:
        """Copy host blocks to the remote tier in the background (slots pinned meanwhile): those
        ``remote.admission`` admits, or with ``every`` all of them.

        Returns:
            With ``every``, the jobs writing any of ``blocks`` (this call's and those already in
            flight), for a caller that waits until they are on the remote; otherwise an empty list.
        """
        st = self.st
        if st.remote is None:
            return []
        mode = st.cfg.remote.admission
        todo = [b for b in blocks if not b.on_remote and b.host_ready and (every or st.hostp.worth_writing(b, mode))]
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
                st.remote_stats.bytes_in += b.nbytes
            else:
                b.on_remote = False

        job = st.engine.store_remote(st.remote, self._moves(todo), on_done=completion(st.changed, todo, each))
        if not job.done.is_set():  # its completion, which forgets it, waits for the lock the caller holds
            self._inflight.update(dict.fromkeys((b.fk for b in todo), job))
        if every:
            jobs[id(job)] = job
        return list(jobs.values())

    # ---- disk -> host -----------------------------------------------------------------------------
    def load(self, ns: Namespace, blocks: list[Block]) -> Job:
        """Read disk values into the host slots already assigned to ``blocks`` (``loading`` set)."""
        st = self.st
        bad: list[bytes] = []

        def each(b: Block, m: Move) -> None:
            ev = settle(b)
            if m.ok:
                st.hostp.inserted(b)
                st.diskp.stats.hits += 1
                st.diskp.stats.bytes_out += b.nbytes
                st.hostp.stats.promotions += 1
            else:  # a bad value is a miss: drop the entry everywhere, never serve it
                st.hostp.free_failed(b)
                st.diskp.stats.misses += 1
                if m.error.startswith("io"):
                    st.degraded = m.error
                    st.diskp.stats.errors += 1
                else:
                    st.diskp.stats.corrupt += 1
                    bad.append(b.fk)
                st.diskp.forget(b)
            if ev is not None:
                ev.set()

        def delete_bad(_job: Job) -> None:
            if bad and st.disk is not None:
                try:
                    st.disk.delete(bad)
                except Exception as exc:  # the records are gone already; a stale value is re-verified anyway
                    log.warning("could not delete corrupt values: %s", exc)

        moves_ = moves(blocks, st.host.view, lambda _b: ns.layout)
        return st.engine.load(moves_, on_done=completion(st.changed, blocks, each, after=delete_bad))

    def start_loads(self, blocks: list[Block]) -> None:
        """Mark blocks whose host slot was just assigned as loading (their reads start in one job)."""
        for b in blocks:
            b.loading = threading.Event()
            b.load_failed = False

    # ---- remote -> host ---------------------------------------------------------------------------
    def load_remote(self, blocks: list[Block]) -> None:
        """Fetch blocks from the remote tier into their host slots (records made, ``loading`` set)."""
        st = self.st

        def each(b: Block, m: Move) -> None:
            ev = settle(b)
            if m.ok:
                st.hostp.inserted(b)
                st.remote_stats.hits += 1
                st.remote_stats.bytes_out += b.nbytes
            else:  # a miss (gone, corrupt or the remote is down): never served
                st.hostp.free_failed(b)
                st.remote_stats.misses += 1
                st.diskp.forget(b)
            if ev is not None:
                ev.set()

        st.engine.load_remote(st.remote, self._moves(blocks), on_done=completion(st.changed, blocks, each))


def ready_after(b: Block, ev: threading.Event | None) -> Any:
    """For a copy out of ``b``'s host slot: wait until a load into that slot finished; False if it failed."""
    def ready() -> bool:
        if ev is not None:
            ev.wait(120.0)
        return not b.load_failed and b.host_off is not None and b.loading is None
    return ready

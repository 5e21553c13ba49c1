"""The evictor: a daemon thread that demotes host blocks between the watermarks, retries GPU drains
that found no host slot, and writes cold dirty blocks behind while the disk writer is idle."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierkv.daemon.blockstore import BlockStore
    from tierkv.movers.jobs import Job

log = logging.getLogger("tierkv.table")

# A write-behind batch takes at most this share of the host tier: the blocks it holds are pinned until
# written, and the rest of the tier must keep blocks a store can drop when the writer falls behind.
WRITE_BEHIND_SHARE = 1 / 8


class Evictor:
    """Runs when kicked (a store filled the tier, a write finished) and every half second."""

    def __init__(self, st: BlockStore) -> None:
        self.st = st
        self._kick = threading.Event()
        self._force = False
        self._wb_job: Job | None = None  # the write-behind batch in flight
        self._thread = threading.Thread(target=self._loop, name="tierkv-evictor", daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def kick(self, force: bool = False) -> None:
        """Run soon; ``force``: demote at least a slab even below the high watermark."""
        self._force = force or self._force
        self._kick.set()

    def wake(self) -> None:
        """Run soon (a transfer it may wait on finished)."""
        self._kick.set()

    def stop(self) -> None:
        """Stop the thread (the store is closing)."""
        self._kick.set()
        self._thread.join(5)

    def _loop(self) -> None:
        st = self.st
        while not st.closing:
            self._kick.wait(0.5)
            self._kick.clear()
            try:
                self._demote_once()
                if st.gpu_path is not None and st.gpu_path.undrained:
                    st.gpu_path.retry_drains()
                self._write_behind()
            except Exception:
                log.exception("evictor")

    def _demote_once(self) -> None:
        """Write dirty victims back, then free their slots (clean victims are dropped at once)."""
        st = self.st
        with st.lock:
            force, self._force = self._force, False
            dirty = st.hostp.demotion(force)
            st.changed.notify_all()
            job = st.transfers.store(dirty) if dirty else None
        if job is None:
            return
        job.wait()
        with st.lock:
            st.hostp.demoted(dirty)
            st.changed.notify_all()

    def _write_behind(self) -> None:
        """Clean the coldest admitted dirty host blocks while the disk writer is idle: a later eviction
        then only frees their slots, so a burst of stores runs at memory speed instead of disk speed."""
        st = self.st
        if st.disk is None or not st.cfg.host.write_behind or st.closing:
            return
        if self._wb_job is not None and not self._wb_job.done.is_set():
            return  # one batch at a time; its completion wakes the evictor for the next
        with st.lock:
            batch = min(st.engine.writes.batch_bytes, int(st.hostp.limit * WRITE_BEHIND_SHARE))
            victims = st.hostp.write_behind_batch(batch)
            if victims:
                self._wb_job = st.transfers.store(victims)

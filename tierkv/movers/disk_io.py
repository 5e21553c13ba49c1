"""Disk I/O: host -> disk stores, disk -> host loads and verify scans, with the codecs.

Stores encode on worker threads (zstd releases the GIL, so several blocks are in flight) and are
written by one writer thread in batched LMDB transactions, group-committed. A store job carries the
deletes the daemon chose to make room for it; a full map or file system comes back as the job's result
(``full``), and the writer never asks the daemon for anything. Loads read and decode on their own worker
pool, so a load never queues behind stores; a verify job decodes every stored value on that pool.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from tierkv.codecs import CodecError, ForeignBlock, decode_block, encode_block, read_header
from tierkv.core.errors import TierFull, TierKVError
from tierkv.core.keys import FINGERPRINT_BYTES
from tierkv.core.layout import Layout
from tierkv.movers.budget import LinkBudgets
from tierkv.movers.cpu_share import CpuShare
from tierkv.movers.jobs import Job, JobBook, Move
from tierkv.movers.priority import lower_this_thread
from tierkv.tiers.disk import DiskError, DiskTier

log = logging.getLogger("tierkv.movers.engine")
# Group commit: a written store job waits for the one sync that makes it durable at most this many jobs
# or seconds (less when the writer finds nothing else queued).
GROUP_COMMIT_JOBS = 8
GROUP_COMMIT_S = 0.05
LOAD_THREADS = 4  # at least this many disk -> host loads in flight (see TransferEngine.__init__)
GIVE_WAY_POLL_S = 0.01  # how often a background job waiting for its encodes looks for a job queued behind it


@dataclass
class DiskWrites:
    """Settings of new disk writes; ``tierkv tune`` changes them while the daemon runs."""

    codec: str = "lossless"   # codec of new values
    level: int = 1            # its zstd level
    batch: int = 32           # most blocks in one transaction
    batch_bytes: int = 48 << 20  # about the most bytes in one transaction


class DiskMover:
    """Stores, loads and verify scans between the host tier and the disk tier.

    Args:
        disk: the disk tier.
        book: the engine's job ids and link counters.
        budgets: the link budgets (``host<->disk``).
        encode: worker pool for encodes; decode: worker pool for loads and verify scans.
        writes: codec, level and transaction size of new writes (read at each write).
        write_nice: CPU nice steps of the writer thread (0: the daemon's own).
        write_idle: run the writer thread in the idle scheduling class instead.
        encode_background: worker pool for the encodes of background jobs (None: ``encode``).
        cpu_share: bounds the encodes and writes of bounded jobs while the engine is busy (None: no bound).
    """

    def __init__(self, disk: DiskTier, book: JobBook, budgets: LinkBudgets, encode: ThreadPoolExecutor,
                 decode: ThreadPoolExecutor, writes: DiskWrites, write_nice: int = 0, write_idle: bool = False,
                 encode_background: ThreadPoolExecutor | None = None, cpu_share: CpuShare | None = None) -> None:
        self.disk = disk
        self.writes = writes
        self._book = book
        self._budgets = budgets
        self._encode = encode
        self._encode_bg = encode_background or encode
        self._share = cpu_share
        self._decode = decode
        self._orphans: list[bytes] = []  # deletes the daemon chose whose transaction failed: retried
        self._stores: queue.Queue[Job | None] = queue.Queue()
        self._write_nice, self._write_idle = write_nice, write_idle
        self._writer = threading.Thread(target=self._write_loop, name="tierkv-disk-writer", daemon=True)
        self._writer.start()

    # ---- stores: host -> disk -------------------------------------------------------------------
    def store(self, job: Job) -> None:
        """Queue an encode + write of the job's moves with its deletes; the slots must stay untouched
        until the job is done. A job without moves only deletes."""
        if self._stores.qsize() < 2:  # its first batch encodes now, while the writer finishes the job before
            try:
                self._encode_first(job)
            except RuntimeError:  # the engine is closing: the writer (if still there) encodes it
                job.encoded = []
        self._stores.put(job)

    def store_backlog(self) -> int:
        """Store jobs queued behind the one being written (0: the writer keeps up)."""
        return self._stores.qsize()

    def _write_loop(self) -> None:
        # Group commit: each commit syncs its data pages, and one sync of the meta page makes every
        # commit before it durable. Jobs written back to back share that sync: a job is finished (a
        # durable put acknowledged) once the writer finds the queue empty, or several jobs or a
        # moment have gone by, and has synced.
        unsynced: list[tuple[Job, float]] = []  # written, not yet synced: (job, when written)
        lower_this_thread(self._write_nice, self._write_idle)
        while True:
            job = self._stores.get()
            if job is None:
                self._sync(unsynced)
                return
            jobs = [job] + self._take_queued(job)
            t0 = time.perf_counter()
            self._write_guarded(jobs)
            seconds = time.perf_counter() - t0
            self._book.link_seconds["host->disk"] += seconds
            for j in jobs:
                j.seconds = seconds
                unsynced.append((j, t0 + seconds))  # when it was written
            if self._stores.empty() or len(unsynced) >= GROUP_COMMIT_JOBS or \
                    time.perf_counter() - unsynced[0][1] > GROUP_COMMIT_S:
                self._sync(unsynced)
                unsynced = []

    def _write_guarded(self, jobs: list[Job]) -> None:
        """Write ``jobs``; a failure fails each of them, and never ends the writer thread."""
        try:
            self._write_jobs(jobs)
        except TierKVError as exc:
            for j in jobs:
                j.error = exc
                j.full = isinstance(exc, TierFull)  # the daemon decides what to drop
            self._book.failures += 1
            log.warning("disk write of %d blocks failed: %s", sum(len(j.moves) for j in jobs), exc)
        except Exception as exc:
            for j in jobs:
                j.error = TierKVError(f"disk write failed: {exc}")
            self._book.failures += 1
            log.exception("disk writer")

    def _take_queued(self, job: Job) -> list[Job]:
        """Store jobs queued behind ``job`` that fit in its transaction: several small commits (a
        streamed put's first chunks, many one-block puts) cost more than one of their total size."""
        if not job.moves:
            return []
        size, count = sum(m.view.nbytes for m in job.moves), len(job.moves)
        taken: list[Job] = []
        with self._stores.mutex:
            q = self._stores.queue
            while q and q[0] is not None and q[0].moves and q[0].background == job.background \
                    and q[0].bounded == job.bounded:
                more = sum(m.view.nbytes for m in q[0].moves)
                if size + more > self.writes.batch_bytes or count + len(q[0].moves) > self.writes.batch:
                    break
                size, count = size + more, count + len(q[0].moves)
                taken.append(q.popleft())
        return taken

    def _sync(self, jobs: list[tuple[Job, float]]) -> None:
        """One sync for the written jobs, then finish them (a failed sync fails those not failed yet)."""
        if not jobs:
            return
        t0 = time.perf_counter()
        try:
            self.disk.flush()
        except TierKVError as exc:
            self._book.failures += 1
            log.warning("disk sync failed: %s", exc)
            for job, _ in jobs:
                if job.error is None:
                    job.error = exc
        self._book.link_seconds["host->disk"] += time.perf_counter() - t0
        for job, _ in jobs:
            self._book.finish(job)

    def _encode_ahead(self) -> None:
        """Start encoding the first batch of the next queued store while this one is written."""
        with self._stores.mutex:
            nxt = self._stores.queue[0] if self._stores.queue else None
        if nxt is not None and not nxt.encoded:
            self._encode_first(nxt)

    def _pool(self, job: Job) -> ThreadPoolExecutor:
        return self._encode_bg if job.background else self._encode

    def _encoder(self, job: Job) -> Callable[[Move], bytes | None]:
        """How ``job``'s moves encode: within the CPU share when it is bounded."""
        share = self._share
        if share is None or not job.bounded:
            return self._encode_one
        return lambda m: share.timed(lambda: self._encode_one(m), self._foreground_queued)  # type: ignore[return-value]

    def _encode_first(self, job: Job) -> None:
        size, pool, encode = 0, self._pool(job), self._encoder(job)
        for m in job.moves:
            if size >= self.writes.batch_bytes:
                break
            job.encoded.append(pool.submit(encode, m))
            size += m.view.nbytes

    def _foreground_queued(self) -> bool:
        """A job that is not background (or the close) waits in the queue."""
        with self._stores.mutex:
            return any(j is None or not j.background for j in self._stores.queue)

    def _results(self, futures: list[Future], background: bool) -> tuple[list[bytes | None], bool]:
        """The encoded values of ``futures`` in order, and whether a background job gave way: it stops
        at the first value not encoded while another job is queued behind it."""
        if not background:
            return [f.result() for f in futures], False
        out: list[bytes | None] = []
        for f in futures:
            while True:
                try:
                    out.append(f.result(timeout=GIVE_WAY_POLL_S))
                    break
                except FutureTimeout:
                    if self._foreground_queued():
                        return out, True
                except CancelledError:  # the engine is closing
                    return out, True
        return out, False

    def _write_jobs(self, jobs: list[Job]) -> None:
        """Encode on the workers while this thread writes: batch i is written as batch i+1 encodes."""
        deletes = [k for j in jobs for k in j.deletes]
        if not jobs[0].moves:
            self._commit([], self._orphans + deletes)
            return
        futures: list[Future] = []
        all_moves: list[Move] = []
        pool, background = self._pool(jobs[0]), jobs[0].background
        for job in jobs:
            encode = self._encoder(job)
            futures += job.encoded + [pool.submit(encode, m) for m in job.moves[len(job.encoded):]]
            job.encoded = []
            all_moves += job.moves
        i = 0
        while i < len(all_moves):
            # A transaction of about writes.batch_bytes: large enough to amortise its two fsyncs, small
            # enough that the next batch encodes while this one is written.
            j, size = i, 0
            while j < len(all_moves) and (j == i or size < self.writes.batch_bytes) and j - i < self.writes.batch:
                size += all_moves[j].view.nbytes
                j += 1
            blobs, gave_way = self._results(futures[i:j], background)
            if blobs or deletes:
                batch = all_moves[i:i + len(blobs)]
                if self._share is not None and jobs[0].bounded:
                    self._share.timed(functools.partial(self._write_batch, batch, blobs, deletes),
                                      self._foreground_queued)
                else:
                    self._write_batch(batch, blobs, deletes)
            deletes = []  # written with the first transaction
            if gave_way:  # the moves not written keep ok False: their blocks stay dirty
                # An encode already running may still read its slot after the job ends (the slot may
                # then be reused): its value is never written, so only that wasted read remains.
                for f in futures[i + len(blobs):]:
                    f.cancel()
                return
            i = j
        # No sync here: the write loop syncs once for these jobs and any written right after them.

    def _write_batch(self, moves: list[Move], blobs: list[bytes | None], deletes: list[bytes]) -> None:
        """One transaction: the encoded ``blobs`` of ``moves`` and the ``deletes`` the daemon chose."""
        self._encode_ahead()
        puts = [(m.lmdb_key, b) for m, b in zip(moves, blobs) if b is not None]
        # Values the table evicted while a failed write held them are deleted with the next one.
        deletes = self._orphans + deletes
        # Admit block by block: one large request would pass a full bucket at once.
        for _, blob in puts:
            self._budgets.acquire("host<->disk", len(blob))
        with self._budgets.transfer("host<->disk", 0):
            self._commit(puts, deletes)
        for m, b in zip(moves, blobs):
            m.ok = b is not None
            m.stored_bytes = len(b) if b is not None else 0
        self._book.link_bytes["host->disk"] += sum(m.view.nbytes for m in moves if m.ok)

    def _commit(self, puts: list[tuple[bytes, bytes]], deletes: list[bytes]) -> None:
        """Write ``puts`` and ``deletes`` in one transaction; on failure the deletes wait for the next."""
        try:
            self.disk.write(puts, deletes)
        except TierKVError:
            self._orphans = deletes  # the table forgot them already: LMDB must follow
            raise
        self._orphans = []

    def _encode_one(self, m: Move) -> bytes | None:
        try:
            return encode_block(m.view, layout=m.layout, fingerprint=m.fingerprint, key=m.key, codec=self.writes.codec,
                                level=self.writes.level)
        except Exception as exc:
            m.error = f"encode failed: {exc}"
            return None

    # ---- loads: disk -> host --------------------------------------------------------------------
    def load(self, job: Job) -> None:
        """Read and decode the job's moves into their host slots in parallel; a bad value leaves ``ok``
        False and says why in ``error`` (``absent``, ``corrupt: ...``, ``io: ...``)."""
        moves: list[Move] = job.moves
        t0 = time.perf_counter()
        futures = [self._decode.submit(self._load_one, m) for m in moves]
        remaining = [len(futures)]
        lock = threading.Lock()

        def one_done(_f: Any) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                job.seconds = time.perf_counter() - t0
                self._book.link_seconds["disk->host"] += job.seconds
                got = sum(m.view.nbytes for m in moves if m.ok)
                self._book.link_bytes["disk->host"] += got
                self._book.finish(job)

        if not futures:
            self._book.finish(job)
        for f in futures:
            f.add_done_callback(one_done)

    def _load_one(self, m: Move) -> None:
        self._budgets.acquire("host<->disk", m.view.nbytes)

        def use(value: memoryview) -> int:
            decode_block(value, layout=m.layout, fingerprint=m.fingerprint, key=m.key, out=m.view)
            return len(value)

        try:
            got = self.disk.read(m.lmdb_key, use)
            if got is None:
                m.error = "absent"
            else:
                m.stored_bytes = got
                m.ok = True
        except ForeignBlock as exc:
            m.error = f"foreign: {exc}"
        except CodecError as exc:
            m.error = f"corrupt: {exc}"
        except DiskError as exc:
            m.error = f"io: {exc}"
        except Exception as exc:
            m.error = f"load failed: {exc}"
            log.exception("disk load")

    # ---- verify: decode every stored value ---------------------------------------------------------
    def verify(self, job: Job) -> None:
        """Decode every stored value (header, sizes, checksum) on the load pool; the job reports how many
        it checked and each bad one (``bad``). Nothing is deleted: that is the daemon's choice."""
        def run() -> None:
            t0 = time.perf_counter()
            try:
                for lk, value in self.disk.scan():
                    job.checked += 1
                    error = _check(lk, value)
                    if error:
                        job.bad.append((bytes(lk), error))
            except TierKVError as exc:
                job.error = exc
            except Exception as exc:
                job.error = TierKVError(f"verify failed: {exc}")
                log.exception("disk verify")
            job.seconds = time.perf_counter() - t0
            self._book.finish(job)

        self._decode.submit(run)

    def close(self, timeout: float) -> None:
        """Write the queued stores (bounded by ``timeout``), then stop the writer thread."""
        self._stores.put(None)
        self._writer.join(timeout)


def _check(lk: bytes, value: memoryview) -> str:
    """Why a stored value is bad ("" when it decodes under its key's namespace)."""
    try:
        h = read_header(value)
        if bytes(h.fingerprint) != lk[:FINGERPRINT_BYTES]:
            raise CodecError("namespace fingerprint differs from the key's")
        decode_block(value, layout=Layout.from_dict(h.layout), fingerprint=lk[:FINGERPRINT_BYTES],
                     key=lk[FINGERPRINT_BYTES:])
    except (CodecError, ValueError) as exc:
        return str(exc)
    return ""

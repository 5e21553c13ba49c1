"""Transfer engine: moves block bytes between tiers as jobs with ids; the block table decides what moves.

Routes by (source tier, destination tier). Host -> disk stores encode on worker threads (zstd releases
the GIL, so several blocks are in flight) and are written by one writer thread in batched LMDB
transactions. Disk -> host loads read and decode on their own worker pool, so a load never queues
behind stores. Only this module (and, later, its CUDA stream handlers) moves bulk bytes.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tierkv.cache.costmodel import CostModel
from tierkv.codecs import CodecError, decode_block, encode_block
from tierkv.core.errors import TierKVError
from tierkv.core.layout import Layout
from tierkv.movers.budget import LinkBudgets
from tierkv.movers.remote import RemoteMover
from tierkv.movers.streams import Copy
from tierkv.tiers.disk import DiskError, DiskTier

log = logging.getLogger("tierkv.movers.transfer")
# Group commit: a written store job waits for the one sync that makes it durable at most this many jobs
# or seconds (less when the writer finds nothing else queued).
GROUP_COMMIT_JOBS = 8
GROUP_COMMIT_S = 0.05
LOAD_THREADS = 4  # at least this many disk -> host loads in flight (see TransferEngine.__init__)


@dataclass(slots=True)
class Move:
    """One block to move: its LMDB key, the host slot view, and what identifies its bytes."""

    lmdb_key: bytes
    view: np.ndarray
    layout: Layout
    fingerprint: bytes
    key: bytes
    ok: bool = False
    stored_bytes: int = 0
    error: str = ""


@dataclass
class Job:
    """A batch of moves; ``done`` is set when every move finished (check each ``Move.ok``)."""

    id: int
    route: tuple[str, str]
    moves: list[Move]
    done: threading.Event = field(default_factory=threading.Event)
    error: TierKVError | None = None
    seconds: float = 0.0
    on_done: Callable[[Job], None] | None = None
    # Stores: encodes of the first moves, submitted while the job before it was being written.
    encoded: list[Future] = field(default_factory=list)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job finishes; False on timeout."""
        return self.done.wait(timeout)


class TransferEngine:
    """Jobs by route: ("host", "disk") stores and ("disk", "host") loads."""

    def __init__(self, disk: DiskTier | None, workers: int = 2, codec: str = "lossless", level: int = 1,
                 make_room: Callable[[int], list[bytes]] | None = None, write_batch: int = 32,
                 budgets: dict[str, float | None] | None = None) -> None:
        self.disk = disk
        self.write_batch = write_batch
        self.write_batch_bytes = 48 << 20
        self.budgets = LinkBudgets(budgets or {})
        self.cost = CostModel()
        self.codec = codec
        self.level = level
        self._make_room = make_room
        self._orphans: list[bytes] = []  # evicted by the table, still in LMDB (their delete failed)
        self._ids = itertools.count(1)
        self._encode = ThreadPoolExecutor(workers, thread_name_prefix="tierkv-encode")
        # A load mostly waits on the device (an O_DIRECT read, GIL released), then decodes: more loads in
        # flight than cores keep the disk busy while others decode (measured, cold lossless loads on 2
        # cores: 1.3 GB/s with 2 threads, 1.6 with 4, 1.8 with 8).
        self._decode = ThreadPoolExecutor(max(workers, LOAD_THREADS), thread_name_prefix="tierkv-decode")
        # one writer keeps remote write-through in commit order and off the load path
        self._remote_writer = ThreadPoolExecutor(1, thread_name_prefix="tierkv-remote-writer")
        self._remote: RemoteMover | None = None
        self._stores: queue.Queue[Job | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="tierkv-disk-writer", daemon=True)
        self._writer.start()
        self.inflight = 0
        self._lock = threading.Lock()
        self.link_bytes: dict[str, int] = {"host->disk": 0, "disk->host": 0}
        self.link_seconds: dict[str, float] = {"host->disk": 0.0, "disk->host": 0.0}
        self.failures = 0
        self.device: Any = None    # the GPU tier's pool once attach_device ran
        self._registered = 0       # host pool address registered with cudaHostRegister

    # ---- stores: host -> disk -------------------------------------------------------------------
    def store(self, moves: list[Move], on_done: Callable[[Job], None] | None = None) -> Job:
        """Queue an encode + write of ``moves``; the slots must stay untouched until the job is done."""
        job = Job(next(self._ids), ("host", "disk"), moves, on_done=on_done)
        with self._lock:
            self.inflight += 1
        if self._stores.qsize() < 2:  # its first batch encodes now, while the writer finishes the job before
            try:
                self._encode_first(job)
            except RuntimeError:  # the engine is closing: the writer (if still there) encodes it
                job.encoded = []
        self._stores.put(job)
        return job

    def store_backlog(self) -> int:
        """Store jobs queued behind the one being written (0: the writer keeps up)."""
        return self._stores.qsize()

    def _write_loop(self) -> None:
        # Group commit: each commit syncs its data pages, and one sync of the meta page makes every
        # commit before it durable. Jobs written back to back share that sync: a job is finished (a
        # durable put acknowledged) once the writer finds the queue empty, or several jobs or a
        # moment have gone by, and has synced.
        unsynced: list[tuple[Job, float]] = []  # written, not yet synced: (job, when written)
        while True:
            job = self._stores.get()
            if job is None:
                self._sync(unsynced)
                return
            jobs = [job] + self._take_queued(job)
            t0 = time.perf_counter()
            try:
                self._write_jobs(jobs)
            except TierKVError as exc:
                for j in jobs:
                    j.error = exc
                self.failures += 1
                log.warning("disk write of %d blocks failed: %s", sum(len(j.moves) for j in jobs), exc)
            except Exception as exc:  # never let the writer thread die
                for j in jobs:
                    j.error = TierKVError(f"disk write failed: {exc}")
                self.failures += 1
                log.exception("disk writer")
            seconds = time.perf_counter() - t0
            self.link_seconds["host->disk"] += seconds
            for j in jobs:
                j.seconds = seconds
                unsynced.append((j, t0 + seconds))  # when it was written
            if self._stores.empty() or len(unsynced) >= GROUP_COMMIT_JOBS or \
                    time.perf_counter() - unsynced[0][1] > GROUP_COMMIT_S:
                self._sync(unsynced)
                unsynced = []

    def _take_queued(self, job: Job) -> list[Job]:
        """Store jobs queued behind ``job`` that fit in its transaction: several small commits (a
        streamed put's first chunks, many one-block puts) cost more than one of their total size."""
        if not job.moves:
            return []
        size, count = sum(m.view.nbytes for m in job.moves), len(job.moves)
        taken: list[Job] = []
        with self._stores.mutex:
            q = self._stores.queue
            while q and q[0] is not None and q[0].moves:
                more = sum(m.view.nbytes for m in q[0].moves)
                if size + more > self.write_batch_bytes or count + len(q[0].moves) > self.write_batch:
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
            if self.disk is not None:
                self.disk.flush()
        except TierKVError as exc:
            self.failures += 1
            log.warning("disk sync failed: %s", exc)
            for job, _ in jobs:
                if job.error is None:
                    job.error = exc
        self.link_seconds["host->disk"] += time.perf_counter() - t0
        for job, _ in jobs:
            self._finish(job)

    def _encode_ahead(self) -> None:
        """Start encoding the first batch of the next queued store while this one is written."""
        with self._stores.mutex:
            nxt = self._stores.queue[0] if self._stores.queue else None
        if nxt is not None and not nxt.encoded:
            self._encode_first(nxt)

    def _encode_first(self, job: Job) -> None:
        size = 0
        for m in job.moves:
            if size >= self.write_batch_bytes:
                break
            job.encoded.append(self._encode.submit(self._encode_one, m))
            size += m.view.nbytes

    def _write_jobs(self, jobs: list[Job]) -> None:
        """Encode on the workers while this thread writes: batch i is written as batch i+1 encodes."""
        assert self.disk is not None
        if not jobs[0].moves and self._make_room:
            deletes = self._orphans + self._make_room(0)
            try:
                self.disk.write([], deletes)
            except TierKVError:
                self._orphans = deletes
                raise
            self._orphans = []
            return
        futures: list[Future] = []
        all_moves: list[Move] = []
        for job in jobs:
            futures += job.encoded + [self._encode.submit(self._encode_one, m) for m in job.moves[len(job.encoded):]]
            job.encoded = []
            all_moves += job.moves
        i = 0
        while i < len(all_moves):
            # A transaction of about write_batch_bytes: large enough to amortise its two fsyncs, small
            # enough that the next batch encodes while this one is written.
            j, size = i, 0
            while j < len(all_moves) and (j == i or size < self.write_batch_bytes) and j - i < self.write_batch:
                size += all_moves[j].view.nbytes
                j += 1
            moves = all_moves[i:j]
            blobs = [f.result() for f in futures[i:j]]
            i = j
            self._encode_ahead()
            puts = [(m.lmdb_key, b) for m, b in zip(moves, blobs) if b is not None]
            incoming = sum(len(b) for _, b in puts)
            # Values the table evicted while a failed write held them are deleted with the next one.
            deletes = self._orphans + (self._make_room(incoming) if self._make_room else [])
            # Admit block by block: one large request would pass a full bucket at once.
            for _, blob in puts:
                self.budgets.acquire("host<->disk", len(blob))
            try:
                with self.budgets.transfer("host<->disk", 0):
                    self.disk.write(puts, deletes)
            except TierKVError:
                self._orphans = deletes  # the table forgot them already: LMDB must follow
                raise
            self._orphans = []
            for m, b in zip(moves, blobs):
                m.ok = b is not None
                m.stored_bytes = len(b) if b is not None else 0
            self.link_bytes["host->disk"] += sum(m.view.nbytes for m in moves if m.ok)
        # No sync here: the write loop syncs once for these jobs and any written right after them.

    def _encode_one(self, m: Move) -> bytes | None:
        try:
            return encode_block(m.view, layout=m.layout, fingerprint=m.fingerprint, key=m.key, codec=self.codec,
                                level=self.level)
        except Exception as exc:
            m.error = f"encode failed: {exc}"
            return None

    # ---- loads: disk -> host --------------------------------------------------------------------
    def load(self, moves: list[Move], on_done: Callable[[Job], None] | None = None) -> Job:
        """Read and decode ``moves`` into their host slots in parallel; a bad value leaves ``ok`` False."""
        job = Job(next(self._ids), ("disk", "host"), moves, on_done=on_done)
        with self._lock:
            self.inflight += 1
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
                self.link_seconds["disk->host"] += job.seconds
                got = sum(m.view.nbytes for m in moves if m.ok)
                self.link_bytes["disk->host"] += got
                if got:
                    self.cost.observe("disk", got, job.seconds)
                self._finish(job)

        if not futures:
            self._finish(job)
        for f in futures:
            f.add_done_callback(one_done)
        return job

    def _load_one(self, m: Move) -> None:
        assert self.disk is not None

        self.budgets.acquire("host<->disk", m.view.nbytes)

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
        except CodecError as exc:
            m.error = f"corrupt: {exc}"
        except DiskError as exc:
            m.error = f"io: {exc}"
        except Exception as exc:
            m.error = f"load failed: {exc}"
            log.exception("disk load")

    # ---- remote: host <-> remote ---------------------------------------------------------------------
    def load_remote(self, remote: Any, moves: list[Move], on_done: Callable[[Job], None] | None = None) -> Job:
        """Fetch, verify and decode ``moves`` from the remote tier into their host slots (one batch)."""
        mover = self._remote_mover(remote)
        return self._remote_job(("remote", "host"), moves, on_done, self._decode, lambda: mover.fetch(
            [(m.fingerprint, m.key) for m in moves], moves[0].layout, [m.view for m in moves]))

    def store_remote(self, remote: Any, moves: list[Move], on_done: Callable[[Job], None] | None = None) -> Job:
        """Write ``moves`` through to the remote tier (encoded there); the slots stay pinned until done."""
        mover = self._remote_mover(remote)
        return self._remote_job(("host", "remote"), moves, on_done, self._remote_writer, lambda: mover.store(
            [(m.fingerprint, m.key, m.view) for m in moves], moves[0].layout, disk_keys=[m.lmdb_key for m in moves]))

    def _remote_mover(self, remote: Any) -> RemoteMover:
        with self._lock:
            if self._remote is None or self._remote.tier is not remote:
                self._remote = RemoteMover(remote, budgets=self.budgets, disk=self.disk)
            return self._remote

    def _remote_job(self, route: tuple[str, str], moves: list[Move], on_done: Callable[[Job], None] | None,
                    pool: ThreadPoolExecutor, call: Callable[[], list[bool]]) -> Job:
        """Run one remote batch on ``pool``; the tier never raises for remote failures (they are misses)."""
        job = Job(next(self._ids), route, moves, on_done=on_done)
        with self._lock:
            self.inflight += 1

        def run() -> None:
            t0 = time.perf_counter()
            try:
                oks = call()  # the mover admits each block through the host<->remote budget
                for m, ok in zip(moves, oks):
                    m.ok = bool(ok)
            except Exception as exc:  # anything unexpected is still only a miss or a dropped write
                log.warning("remote %s->%s failed: %s", *route, exc)
            job.seconds = time.perf_counter() - t0
            got = sum(m.view.nbytes for m in moves if m.ok)
            if got and route[0] == "remote":
                self.cost.observe("remote", got, job.seconds)
            self._finish(job)

        pool.submit(run)
        return job

    # ---- device: host <-> gpu ---------------------------------------------------------------------
    def attach_device(self, pool: Any, host: Any) -> None:
        """Serve the GPU tier ``pool``: two copy queues (loads on a high-priority stream) and, on CUDA,
        the host pool registered as pinned memory so copies are DMA, not staged."""
        from tierkv.movers.streams import make_queue

        self.device = pool
        if pool.kind == "cuda":
            from tierkv.core import cuda

            ptr = int(host.array.ctypes.data)
            cuda.host_register(ptr, host.capacity)
            self._registered = ptr
        gate = self._device_gate
        self._h2d = make_queue(pool.kind, "h2d", pool.index, high_priority=True, gate=gate)
        self._d2h = make_queue(pool.kind, "d2h", pool.index, high_priority=False, gate=gate)
        self.link_bytes.update({"host->gpu": 0, "gpu->host": 0})
        self.link_seconds.update({"host->gpu": 0.0, "gpu->host": 0.0})

    def _device_gate(self, nbytes: int) -> Any:
        return self.budgets.transfer("gpu<->host", nbytes)

    def to_device(self, copies: list[Copy], on_done: Callable[[list[Copy]], None]) -> Job:
        """Host slots -> GPU slots on the load queue (it never waits behind stores)."""
        return self._device_job(("host", "gpu"), self._h2d, copies, on_done)

    def to_host(self, copies: list[Copy], on_done: Callable[[list[Copy]], None]) -> Job:
        """GPU slots -> host slots on the store queue (the drain behind a GPU-tier commit)."""
        return self._device_job(("gpu", "host"), self._d2h, copies, on_done)

    def _device_job(self, route: tuple[str, str], q: Any, copies: list[Copy],
                    on_done: Callable[[list[Copy]], None]) -> Job:
        job = Job(next(self._ids), route, [])  # its copies report through on_done; done is set after
        link = "->".join(route)
        with self._lock:
            self.inflight += 1
        t0 = time.perf_counter()

        def done(cs: list[Copy]) -> None:
            job.seconds = time.perf_counter() - t0
            with self._lock:
                self.inflight -= 1
                self.link_seconds[link] += job.seconds
                self.link_bytes[link] += sum(c.src.numel() for c in cs if c.ok)
            try:
                on_done(cs)
            finally:
                job.done.set()

        q.submit(copies, done)
        return job

    # ---- lifecycle --------------------------------------------------------------------------------
    def _finish(self, job: Job) -> None:
        with self._lock:
            self.inflight -= 1
        if job.on_done:
            try:
                job.on_done(job)
            except Exception:
                log.exception("job %d completion", job.id)
        job.done.set()

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued jobs (bounded by ``timeout``), then stop the threads."""
        if self.device is not None:
            self._h2d.close()
            self._d2h.close()
            if self._registered:
                from tierkv.core import cuda

                try:
                    cuda.host_unregister(self._registered)
                except Exception as exc:
                    log.warning("cudaHostUnregister: %s", exc)
                self._registered = 0
        self._stores.put(None)
        self._writer.join(timeout)
        self._remote_writer.shutdown(wait=True)
        if self._remote is not None:
            self._remote.close()
        self._encode.shutdown(wait=True)
        self._decode.shutdown(wait=True)

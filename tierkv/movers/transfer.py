"""Transfer engine: moves block bytes between tiers as jobs with ids; the block table decides what moves.

Routes by (source tier, destination tier) to one mover each: host <-> disk (:mod:`tierkv.movers.disk_io`,
stores and loads with the codecs), host <-> remote (:mod:`tierkv.movers.remote`, run here as jobs on the
load pool and one write-through thread) and host <-> gpu (:mod:`tierkv.movers.device_copy`, CUDA streams
or their stand-in). The engine owns the worker pools and the counters they share
(:class:`~tierkv.movers.jobs.JobBook`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tierkv.cache.costmodel import CostModel
from tierkv.movers.budget import LinkBudgets
from tierkv.movers.disk_io import LOAD_THREADS, DiskMover
from tierkv.movers.jobs import Job, JobBook, Move
from tierkv.movers.priority import lower_this_thread
from tierkv.movers.remote import RemoteMover
from tierkv.movers.streams import Copy
from tierkv.tiers.disk import DiskTier

__all__ = ["Job", "Move", "TransferEngine"]
log = logging.getLogger("tierkv.movers.transfer")


class TransferEngine:
    """Jobs by route: host <-> disk stores and loads, host <-> remote, host <-> gpu.

    Args:
        disk: the disk tier, or None.
        workers: encode threads (loads get at least ``LOAD_THREADS``).
        codec, level: codec and zstd level of new disk writes.
        make_room: called before each disk write with its incoming bytes; returns LMDB keys to delete.
        write_batch: most blocks in one disk transaction.
        budgets: bytes/s per link (None or 0: unlimited).
        cost: the cost model fed the measured load rates (None: the engine makes its own).
        write_nice: CPU nice steps of the threads that encode and write blocks to disk (0: the daemon's
            own), so background writes yield the cores to the engine; loads keep the daemon's priority.
    """

    def __init__(self, disk: DiskTier | None, workers: int = 2, codec: str = "lossless", level: int = 1,
                 make_room: Callable[[int], list[bytes]] | None = None, write_batch: int = 32,
                 budgets: dict[str, float | None] | None = None, cost: CostModel | None = None,
                 write_nice: int = 0) -> None:
        self.budgets = LinkBudgets(budgets or {})
        self.cost = CostModel() if cost is None else cost
        self._book = JobBook(("host->disk", "disk->host"))
        self._encode = ThreadPoolExecutor(workers, thread_name_prefix="tierkv-encode", initializer=lower_this_thread,
                                          initargs=(write_nice,))
        # A load mostly waits on the device (an O_DIRECT read, GIL released), then decodes: more loads in
        # flight than cores keep the disk busy while others decode (measured, cold lossless loads on 2
        # cores: 1.3 GB/s with 2 threads, 1.6 with 4, 1.8 with 8).
        self._decode = ThreadPoolExecutor(max(workers, LOAD_THREADS), thread_name_prefix="tierkv-decode")
        self._disk = DiskMover(disk, self._book, self.budgets, self.cost, self._encode, self._decode, codec, level,
                               make_room, write_batch, write_nice)
        # one writer keeps remote write-through in commit order and off the load path
        self._remote_writer = ThreadPoolExecutor(1, thread_name_prefix="tierkv-remote-writer")
        self._remote: RemoteMover | None = None
        self._device: Any = None  # a DeviceMover once attach_device ran

    # ---- settings and counters ---------------------------------------------------------------------
    @property
    def disk(self) -> DiskTier | None:
        """The disk tier, or None."""
        return self._disk.disk

    @property
    def codec(self) -> str:
        """Codec of new disk writes (settable while running)."""
        return self._disk.codec

    @codec.setter
    def codec(self, value: str) -> None:
        self._disk.codec = value

    @property
    def level(self) -> int:
        """zstd level of new disk writes (settable while running)."""
        return self._disk.level

    @level.setter
    def level(self, value: int) -> None:
        self._disk.level = value

    @property
    def write_batch(self) -> int:
        """Most blocks in one disk transaction (settable while running)."""
        return self._disk.write_batch

    @write_batch.setter
    def write_batch(self, value: int) -> None:
        self._disk.write_batch = value

    @property
    def write_batch_bytes(self) -> int:
        """About the most bytes in one disk transaction."""
        return self._disk.write_batch_bytes

    @property
    def inflight(self) -> int:
        """Jobs not finished yet."""
        return self._book.inflight

    @property
    def failures(self) -> int:
        """Disk writes and syncs that failed."""
        return self._book.failures

    @property
    def link_bytes(self) -> dict[str, int]:
        """Bytes moved per link (``"host->disk"``)."""
        return self._book.link_bytes

    @property
    def link_seconds(self) -> dict[str, float]:
        """Seconds spent per link."""
        return self._book.link_seconds

    @property
    def device(self) -> Any:
        """The GPU tier's pool once :meth:`attach_device` ran, else None."""
        return None if self._device is None else self._device.pool

    @property
    def host_pinned(self) -> bool:
        """Whether the host pool is registered as pinned memory (``cudaHostRegister``)."""
        return self._device is not None and bool(self._device.registered)

    # ---- routes ------------------------------------------------------------------------------------
    def store(self, moves: list[Move], on_done: Callable[[Job], None] | None = None) -> Job:
        """Queue an encode + write of ``moves`` to disk; the slots must stay untouched until the job is done.
        An empty job only makes room (deletes what ``make_room(0)`` returns)."""
        return self._disk.store(moves, on_done)

    def store_backlog(self) -> int:
        """Store jobs queued behind the one being written (0: the writer keeps up)."""
        return self._disk.store_backlog()

    def load(self, moves: list[Move], on_done: Callable[[Job], None] | None = None) -> Job:
        """Read and decode ``moves`` from disk into their host slots; a bad value leaves ``ok`` False."""
        return self._disk.load(moves, on_done)

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
        with self._book.lock:
            if self._remote is None or self._remote.tier is not remote:
                self._remote = RemoteMover(remote, budgets=self.budgets, disk=self.disk)
            return self._remote

    def _remote_job(self, route: tuple[str, str], moves: list[Move], on_done: Callable[[Job], None] | None,
                    pool: ThreadPoolExecutor, call: Callable[[], list[bool]]) -> Job:
        """Run one remote batch on ``pool``; the tier never raises for remote failures (they are misses)."""
        job = self._book.open(route, moves, on_done)

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
            self._book.finish(job)

        pool.submit(run)
        return job

    def attach_device(self, pool: Any, host: Any) -> None:
        """Serve the GPU tier ``pool``: two copy queues (loads on a high-priority stream) and, on CUDA,
        the host pool registered as pinned memory so copies are DMA, not staged."""
        from tierkv.movers.device_copy import DeviceMover

        self._device = DeviceMover(self._book, self.budgets, pool, host)

    def to_device(self, copies: list[Copy], on_done: Callable[[list[Copy]], None]) -> Job:
        """Host slots -> GPU slots on the load queue (it never waits behind stores)."""
        return self._device.to_device(copies, on_done)

    def to_host(self, copies: list[Copy], on_done: Callable[[list[Copy]], None]) -> Job:
        """GPU slots -> host slots on the store queue (the drain behind a GPU-tier commit)."""
        return self._device.to_host(copies, on_done)

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued jobs (bounded by ``timeout``), then stop the threads."""
        if self._device is not None:
            self._device.close()
        self._disk.close(timeout)
        self._remote_writer.shutdown(wait=True)
        if self._remote is not None:
            self._remote.close()
        self._encode.shutdown(wait=True)
        self._decode.shutdown(wait=True)

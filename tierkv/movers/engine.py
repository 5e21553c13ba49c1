"""Transfer engine: moves block bytes between tiers as jobs with ids; the daemon decides what moves.

One entry point, :meth:`TransferEngine.submit`, routes a job by (source tier, destination tier) to the
mover serving that route, as vLLM's offloading worker routes transfers by medium:

| route | mover |
|---|---|
| ``host -> disk``, ``disk -> host`` | :mod:`tierkv.movers.disk_io`: encode and write (with the deletes the daemon chose), read and decode |
| ``disk -> verify`` | :mod:`tierkv.movers.disk_io`: decode every stored value, report the bad ones |
| ``host -> remote``, ``remote -> host`` | :mod:`tierkv.movers.remote`, on one write-through thread and the load pool |
| ``host -> gpu``, ``gpu -> host`` | :mod:`tierkv.movers.device_copy`: CUDA streams or their stand-in |

Movers report: each job says per move whether it arrived, and the engine's :class:`~tierkv.movers.jobs.JobBook`
counts bytes and seconds per link. The engine owns the worker pools; it holds no decisions (no cost
model, no eviction).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tierkv.movers.budget import LinkBudgets
from tierkv.movers.cpu_share import CpuShare
from tierkv.movers.disk_io import LOAD_THREADS, DiskMover, DiskWrites
from tierkv.movers.jobs import Job, JobBook, Move, Route
from tierkv.movers.priority import lower_this_thread
from tierkv.movers.remote import RemoteMover
from tierkv.tiers.disk import DiskTier

__all__ = ["LOAD_THREADS", "VERIFY", "DiskWrites", "Job", "Move", "Route", "TransferEngine"]
log = logging.getLogger("tierkv.movers.engine")

VERIFY: Route = ("disk", "verify")  # decode every value on disk; the job's ``bad`` lists what failed


class TransferEngine:
    """Jobs by route: host <-> disk, disk verify, host <-> remote, host <-> gpu.

    Args:
        disk: the disk tier, or None (no disk routes).
        workers: encode threads (loads get at least ``LOAD_THREADS``).
        codec, level: codec and zstd level of new disk writes.
        write_batch: most blocks in one disk transaction.
        budgets: bytes/s per link (None or 0: unlimited).
        write_nice: CPU nice steps of the threads that encode and write blocks to disk (0: the daemon's
            own), so background writes yield the cores to the engine; loads keep the daemon's priority.
        write_idle: run those threads in the idle scheduling class instead (only on cores nothing else wants).
        background_idle: encode background stores (write-behind, demotions: no request waits for them) on
            threads in the idle scheduling class, whatever ``write_idle`` says.
        cpu_share: the share of the cores bounded stores (demotions, write-behind) take while the engine
            keeps the cores busy (None: no bound).
    """

    def __init__(self, disk: DiskTier | None, workers: int = 2, codec: str = "lossless", level: int = 1,
                 write_batch: int = 32, budgets: dict[str, float | None] | None = None,
                 write_nice: int = 0, write_idle: bool = False, background_idle: bool = False,
                 cpu_share: CpuShare | None = None) -> None:
        self.disk = disk
        self.cpu_share = cpu_share
        self.budgets = LinkBudgets(budgets or {})
        self.book = JobBook(("host->disk", "disk->host"))  # jobs in flight, bytes and seconds per link
        self.writes = DiskWrites(codec, level, write_batch)
        self._routes: dict[Route, Callable[[Job], None]] = {}
        self._encode = ThreadPoolExecutor(workers, thread_name_prefix="tierkv-encode", initializer=lower_this_thread,
                                          initargs=(write_nice, write_idle))
        self._encode_bg = self._encode if write_idle or not background_idle else \
            ThreadPoolExecutor(workers, thread_name_prefix="tierkv-encode-bg", initializer=lower_this_thread,
                               initargs=(write_nice, True))
        # A load mostly waits on the device (an O_DIRECT read, GIL released), then decodes: more loads in
        # flight than cores keep the disk busy while others decode (measured, cold lossless loads on 2
        # cores: 1.3 GB/s with 2 threads, 1.6 with 4, 1.8 with 8).
        self._decode = ThreadPoolExecutor(max(workers, LOAD_THREADS), thread_name_prefix="tierkv-decode")
        self._disk: DiskMover | None = None
        if disk is not None:
            self._disk = DiskMover(disk, self.book, self.budgets, self._encode, self._decode, self.writes, write_nice,
                                    write_idle, encode_background=self._encode_bg, cpu_share=cpu_share)
            self._routes.update({("host", "disk"): self._disk.store, ("disk", "host"): self._disk.load,
                                 VERIFY: self._disk.verify})
        # one writer keeps remote write-through in commit order and off the load path
        self._remote_writer = ThreadPoolExecutor(1, thread_name_prefix="tierkv-remote-writer")
        self._remote: RemoteMover | None = None
        self._device: Any = None  # a DeviceMover once attach_device ran

    @property
    def routes(self) -> list[Route]:
        """The routes a job may take."""
        return sorted(self._routes)

    @property
    def host_pinned(self) -> bool:
        """Whether the host pool is registered as pinned memory (``cudaHostRegister``)."""
        return self._device is not None and bool(self._device.registered)

    def store_backlog(self) -> int:
        """Disk store jobs queued behind the one being written (0: the writer keeps up)."""
        return 0 if self._disk is None else self._disk.store_backlog()

    # ---- jobs --------------------------------------------------------------------------------------
    def submit(self, route: Route, moves: Sequence[Any], on_done: Callable[[Job], None] | None = None, *,
               deletes: Sequence[bytes] = (), background: bool = False, bounded: bool = False) -> Job:
        """Start a job on ``route``; ``on_done(job)`` runs on a mover thread when it finished.

        The slots of ``moves`` must stay untouched until then. Each move's ``ok`` says whether it arrived.

        Args:
            route: (source tier, destination tier), one of :attr:`routes`.
            moves: a :class:`Move` per block (disk and remote routes; none for a verify or a job that only
                deletes), or a :class:`~tierkv.movers.streams.Copy` per block (device routes).
            on_done: called once with the finished job (an exception there is logged).
            deletes: ``host -> disk`` only: LMDB keys to delete in the job's first transaction (the room
                the daemon made for it).
            background: ``host -> disk`` only: no request waits for the job (write-behind, demotions).
                Its blocks encode on the background pool, and it gives way to a job queued behind it
                that is not background: the moves not encoded by then are not written (``ok`` False,
                no error).
            bounded: ``host -> disk`` only: no request waits for the job (demotions, write-behind): its
                encodes and writes take at most the engine's CPU share (``cpu_share``) while the engine
                keeps the cores busy.

        Raises:
            ValueError: no mover serves ``route``, or ``deletes`` on another route.
        """
        handler = self._routes.get(route)
        if handler is None:
            served = ", ".join(f"{s}->{d}" for s, d in self.routes)
            raise ValueError(f"no mover serves the route {route[0]}->{route[1]} (served: {served or 'none'})")
        if deletes and route != ("host", "disk"):
            raise ValueError(f"only host->disk jobs delete; got deletes on {route[0]}->{route[1]}")
        to_disk = route == ("host", "disk")
        job = self.book.open(route, list(moves), on_done, background=background and to_disk,
                             bounded=(bounded or background) and to_disk)
        job.deletes = list(deletes)
        handler(job)
        return job

    # ---- movers ------------------------------------------------------------------------------------
    def attach_remote(self, remote: Any) -> None:
        """Serve ``host <-> remote`` with the remote tier ``remote`` (blocks the disk holds encoded with
        the remote's codec are sent as stored)."""
        self._remote = RemoteMover(remote, budgets=self.budgets, disk=self.disk)
        self._routes[("remote", "host")] = self._load_remote
        self._routes[("host", "remote")] = self._store_remote

    def attach_device(self, pool: Any, host: Any) -> None:
        """Serve ``host <-> gpu`` with the GPU tier ``pool``: two copy queues (loads on a high-priority
        stream) and, on CUDA, the host pool registered as pinned memory so copies are DMA, not staged."""
        from tierkv.movers.device_copy import DeviceMover

        self._device = DeviceMover(self.book, self.budgets, pool, host)
        self._routes[("host", "gpu")] = self._device.to_device
        self._routes[("gpu", "host")] = self._device.to_host

    def host_view(self, offset: int, nbytes: int) -> Any:
        """A host slot as the device copies take it (a torch view); needs :meth:`attach_device`."""
        if self._device is None:
            raise RuntimeError("no GPU tier attached: host views are for device copies")
        return self._device.host_view(offset, nbytes)

    def _load_remote(self, job: Job) -> None:
        """Fetch, verify and decode the moves from the remote tier into their host slots (one batch)."""
        mover, moves = self._remote, job.moves
        assert mover is not None  # the route exists once attach_remote ran
        self._remote_job(job, self._decode, lambda: mover.fetch(
            [(m.fingerprint, m.key) for m in moves], moves[0].layout, [m.view for m in moves]))

    def _store_remote(self, job: Job) -> None:
        """Write the moves through to the remote tier (encoded there)."""
        mover, moves = self._remote, job.moves
        assert mover is not None  # the route exists once attach_remote ran
        self._remote_job(job, self._remote_writer, lambda: mover.store(
            [(m.fingerprint, m.key, m.view) for m in moves], moves[0].layout, disk_keys=[m.lmdb_key for m in moves]))

    def _remote_job(self, job: Job, pool: ThreadPoolExecutor, call: Callable[[], list[bool]]) -> None:
        """Run one remote batch on ``pool``; the tier never raises for remote failures (they are misses)."""
        def run() -> None:
            t0 = time.perf_counter()
            try:
                oks = call() if job.moves else []  # the mover admits each block through the host<->remote budget
                for m, ok in zip(job.moves, oks):
                    m.ok = bool(ok)
            except Exception as exc:  # anything unexpected is still only a miss or a dropped write
                log.warning("remote %s->%s failed: %s", *job.route, exc)
            job.seconds = time.perf_counter() - t0
            self.book.finish(job)

        pool.submit(run)

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued jobs (bounded by ``timeout``), then stop the threads."""
        if self._device is not None:
            self._device.close()
        if self._disk is not None:
            self._disk.close(timeout)
        self._remote_writer.shutdown(wait=True)
        if self._remote is not None:
            self._remote.close()
        self._encode.shutdown(wait=True)
        if self._encode_bg is not self._encode:  # its jobs gave way to the close: nothing waits for them
            self._encode_bg.shutdown(wait=False, cancel_futures=True)
        self._decode.shutdown(wait=True)

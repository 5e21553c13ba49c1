"""Device copies: host <-> gpu slot copies on two queues, loads on the high-priority one."""

from __future__ import annotations

import logging
import time
from typing import Any

from tierkv.movers.budget import LinkBudgets
from tierkv.movers.jobs import Job, JobBook
from tierkv.movers.streams import Copy, make_queue

log = logging.getLogger("tierkv.movers.engine")


class DeviceMover:
    """Serves the GPU tier ``pool``: two copy queues and, on CUDA, the host pool registered as pinned
    memory so copies are DMA, not staged.

    Args:
        book: the engine's job ids and counters (links ``host->gpu`` and ``gpu->host`` are added).
        budgets: the link budgets (``gpu<->host``).
        pool: the GPU tier's device pool (or its CPU stand-in).
        host: the host pool.
    """

    def __init__(self, book: JobBook, budgets: LinkBudgets, pool: Any, host: Any) -> None:
        self.pool = pool
        self.host = host
        self._host_t: Any = None  # torch view of the whole host pool, made on first use
        self.registered = 0  # host pool address registered with cudaHostRegister
        self._book = book
        self._budgets = budgets
        if pool.kind == "cuda":
            from tierkv.core import cuda

            ptr = int(host.array.ctypes.data)
            cuda.host_register(ptr, host.capacity)
            self.registered = ptr
        self._h2d = make_queue(pool.kind, "h2d", pool.index, high_priority=True, gate=self._gate)
        self._d2h = make_queue(pool.kind, "d2h", pool.index, high_priority=False, gate=self._gate)
        book.add_links("host->gpu", "gpu->host")

    def host_view(self, offset: int, nbytes: int) -> Any:
        """A torch view of a host slot, sliced from one tensor over the whole pool: slots adjacent in
        the pool are then adjacent in one storage, and the copy queues merge them into one copy."""
        if self._host_t is None:
            import torch

            self._host_t = torch.from_numpy(self.host.array)
        return self._host_t[offset:offset + nbytes]

    def _gate(self, nbytes: int) -> Any:
        return self._budgets.transfer("gpu<->host", nbytes)

    def to_device(self, job: Job) -> None:
        """Host slots -> GPU slots on the load queue (it never waits behind stores)."""
        self._run(job, self._h2d)

    def to_host(self, job: Job) -> None:
        """GPU slots -> host slots on the store queue (the drain behind a GPU-tier commit)."""
        self._run(job, self._d2h)

    def _run(self, job: Job, q: Any) -> None:
        """Queue the job's copies on ``q``; the job finishes once the queue reports every copy."""
        link = "->".join(job.route)
        book = self._book
        t0 = time.perf_counter()

        def done(cs: list[Copy]) -> None:
            job.seconds = time.perf_counter() - t0
            job.moves = cs
            with book.lock:
                book.link_seconds[link] += job.seconds
                book.link_bytes[link] += sum(c.src.numel() for c in cs if c.ok)
            book.finish(job)

        q.submit(job.moves, done)

    def close(self) -> None:
        """Stop the copy queues and unregister the host pool."""
        self._h2d.close()
        self._d2h.close()
        if self.registered:
            from tierkv.core import cuda

            try:
                cuda.host_unregister(self.registered)
            except Exception as exc:
                log.warning("cudaHostUnregister: %s", exc)
            self.registered = 0

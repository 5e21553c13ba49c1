"""Remote I/O: host <-> remote batches as jobs; a remote failure is a miss or a dropped write, never raised."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tierkv.cache.costmodel import CostModel
from tierkv.movers.budget import LinkBudgets
from tierkv.movers.jobs import Job, JobBook, Move

log = logging.getLogger("tierkv.movers.transfer")


class RemoteMover:
    """Loads fetched and verified on the engine's load pool; stores written through on one writer.

    Args:
        book: the engine's job ids and counters.
        budgets: the link budgets (``host<->remote``).
        cost: the cost model, fed the measured load rates.
        loads: the worker pool loads run on (shared with disk loads).
    """

    def __init__(self, book: JobBook, budgets: LinkBudgets, cost: CostModel, loads: ThreadPoolExecutor) -> None:
        self._book = book
        self._budgets = budgets
        self._cost = cost
        self._loads = loads
        # one writer keeps remote write-through in commit order and off the load path
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tierkv-remote-writer")

    def load(self, remote: Any, moves: list[Move], on_done: Callable[[Job], None] | None = None) -> Job:
        """Fetch, verify and decode ``moves`` from the remote tier into their host slots (one batch)."""
        return self._job(("remote", "host"), moves, on_done, self._loads, lambda: remote.fetch_verified(
            [(m.fingerprint, m.key) for m in moves], moves[0].layout, [m.view for m in moves]))

    def store(self, remote: Any, moves: list[Move], on_done: Callable[[Job], None] | None = None) -> Job:
        """Write ``moves`` through to the remote tier (encoded there); the slots stay pinned until done."""
        return self._job(("host", "remote"), moves, on_done, self._writer, lambda: remote.store_blocks(
            [(m.fingerprint, m.key, m.view) for m in moves], moves[0].layout))

    def _job(self, route: tuple[str, str], moves: list[Move], on_done: Callable[[Job], None] | None,
             pool: ThreadPoolExecutor, call: Callable[[], list[bool]]) -> Job:
        """Run one remote batch on ``pool``; the tier never raises for remote failures (they are misses)."""
        job = self._book.open(route, moves, on_done)

        def run() -> None:
            t0 = time.perf_counter()
            try:
                with self._budgets.transfer("host<->remote", sum(m.view.nbytes for m in moves)):
                    oks = call()
                for m, ok in zip(moves, oks):
                    m.ok = bool(ok)
            except Exception as exc:  # anything unexpected is still only a miss or a dropped write
                log.warning("remote %s->%s failed: %s", *route, exc)
            job.seconds = time.perf_counter() - t0
            got = sum(m.view.nbytes for m in moves if m.ok)
            if got and route[0] == "remote":
                self._cost.observe("remote", got, job.seconds)
            self._book.finish(job)

        pool.submit(run)
        return job

    def close(self) -> None:
        """Finish the queued write-through batches, then stop the writer."""
        self._writer.shutdown(wait=True)

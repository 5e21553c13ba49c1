"""Transfer jobs: batches of block moves with ids, finished once and polled or called back.

A job is what a mover reports: per move whether it arrived (``ok``), bytes and seconds per link in the
:class:`JobBook`, and for disk jobs whether the map was full (``full``) or, for a verify job, what it
checked. What to make of a result is the daemon's decision."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tierkv.core.errors import TierFull, TierKVError
from tierkv.core.layout import Layout

log = logging.getLogger("tierkv.movers.engine")


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


Route = tuple[str, str]  # (source tier, destination tier)


@dataclass
class Job:
    """A batch of moves; ``done`` is set when every move finished (check each ``ok``).

    ``moves`` holds a :class:`Move` per block on disk and remote routes and a
    :class:`~tierkv.movers.streams.Copy` per block on device routes.
    """

    id: int
    route: Route
    moves: list[Any]
    done: threading.Event = field(default_factory=threading.Event)
    error: TierKVError | None = None
    seconds: float = 0.0
    on_done: Callable[[Job], None] | None = None
    # host -> disk: LMDB keys the daemon chose to delete, written in the job's first transaction.
    deletes: list[bytes] = field(default_factory=list)
    full: bool = False  # host -> disk: the map or the file system was full (nothing of the batch written)
    checked: int = 0    # verify: values decoded
    bad: list[tuple[bytes, str]] = field(default_factory=list)  # verify: (LMDB key, why) of each bad value
    # Stores: encodes of the first moves, submitted while the job before it was being written.
    encoded: list[Future] = field(default_factory=list)
    # host -> disk: nothing waits for it (write-behind); it gives way to a job queued behind it.
    background: bool = False
    # host -> disk: no request waits for it (demotions, write-behind): within the CPU share while the
    # engine keeps the cores busy (:mod:`tierkv.movers.cpu_share`).
    bounded: bool = False

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job finishes; False on timeout."""
        return self.done.wait(timeout)


class JobBook:
    """Job ids, the jobs in flight, and bytes and seconds per link, shared by the movers.

    Args:
        links: the links counted from the start (``"host->disk"``); movers add theirs with :meth:`add_links`.
    """

    def __init__(self, links: tuple[str, ...] = ()) -> None:
        self._ids = itertools.count(1)
        self.lock = threading.Lock()
        self.inflight = 0
        self.failures = 0
        self.link_bytes: dict[str, int] = {}
        self.link_seconds: dict[str, float] = {}
        self.add_links(*links)

    def add_links(self, *links: str) -> None:
        """Start counting ``links`` at zero."""
        self.link_bytes.update(dict.fromkeys(links, 0))
        self.link_seconds.update(dict.fromkeys(links, 0.0))

    def open(self, route: Route, moves: list[Any], on_done: Callable[[Job], None] | None = None,
             background: bool = False, bounded: bool = False) -> Job:
        """A new job on ``route``, counted in flight until :meth:`finish`."""
        job = Job(next(self._ids), route, moves, on_done=on_done, background=background, bounded=bounded)
        with self.lock:
            self.inflight += 1
        return job

    def finish(self, job: Job) -> None:
        """Count ``job`` done, run its callback (an exception there is logged), then set ``done``."""
        with self.lock:
            self.inflight -= 1
        if job.on_done:
            try:
                job.on_done(job)
            except Exception:
                log.exception("job %d completion", job.id)
        job.done.set()


def failed_job(route: Route, moves: list[Any], error: TierKVError) -> Job:
    """A job that never ran: finished, with ``error`` and every move not ok."""
    job = Job(0, route, moves, error=error, full=isinstance(error, TierFull))
    job.done.set()
    return job

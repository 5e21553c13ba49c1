"""Transfer jobs: batches of block moves with ids, finished once and polled or called back."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from tierkv.core.errors import TierKVError
from tierkv.core.layout import Layout

log = logging.getLogger("tierkv.movers.transfer")


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

    def open(self, route: tuple[str, str], moves: list[Move], on_done: Callable[[Job], None] | None = None) -> Job:
        """A new job on ``route``, counted in flight until :meth:`finish`."""
        job = Job(next(self._ids), route, moves, on_done=on_done)
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

"""Loads beside vLLM's forward pass: a thread of their own with its own connection to the daemon.

Each batch submitted together is fetched at once (the daemon starts every promotion); each load is
waited for up to its bound, copied into vLLM's pages on a side stream where there is a GPU, and
reported with how many of its blocks arrived.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tierkv.core.errors import TierKVError
from tierkv.integrations.vllm.blockio import BlockIO
from tierkv.integrations.vllm.link import Link
from tierkv.integrations.vllm.pages import VllmPages

__all__ = ["AsyncLoads", "Outcome"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """One finished asynchronous load: its blocks ``io.block_ids[:arrived]`` are in vLLM's pages, the rest
    did not arrive; ``seconds`` from submission to done."""

    io: BlockIO
    arrived: int
    seconds: float


class AsyncLoads:
    """Loads that run on a thread of their own, beside vLLM's forward pass.

    Each batch submitted together is fetched at once (the daemon starts every promotion), then each
    request is waited for up to its bound (``BlockIO.wait_s`` from submission), copied into vLLM's
    pages on a side stream where there is a GPU, and marked done. Nothing raises out of the thread: a
    failed or late load is a done request whose missing blocks vLLM recomputes. A request whose thread
    is stuck past its bound (a daemon that stopped answering) is given up by :meth:`take`; the thread
    then never writes its pages.

    Args:
        link: this thread's own connection to the daemon.
        pages: the worker's paged caches.
        warn: the connector's rate-limited warning.
        grace_s: how long past its bound a request may stay unreported before it is given up.
    """

    def __init__(self, link: Link, pages: VllmPages, warn: Callable[[str, BaseException], None],
                 grace_s: float = 1.0) -> None:
        self.link, self.pages, self._warn, self.grace_s = link, pages, warn, grace_s
        self._queue: queue.SimpleQueue[tuple[int, BlockIO, float]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[BlockIO, float]] = {}  # id -> (load, submitted at)
        self._copying: set[int] = set()  # ids whose blocks are being copied into vLLM's pages
        self._next_id = 0
        self._outcomes: list[Outcome] = []
        self._thread: threading.Thread | None = None
        self._stream = torch.cuda.Stream(pages.device) if pages.device.type == "cuda" else None

    @property
    def in_flight(self) -> int:
        """Requests submitted and not reported yet."""
        with self._lock:
            return len(self._pending)

    def submit(self, io: BlockIO) -> None:
        """Queue one request's load (its bound starts now)."""
        now = time.monotonic()
        with self._lock:
            self._next_id += 1
            self._pending[self._next_id] = (io, now)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tierkv-async-load", daemon=True)
                self._thread.start()
            self._queue.put((self._next_id, io, now))

    def take(self) -> list[Outcome]:
        """The loads finished since the last call; loads past their bound and grace are given up here,
        none of their blocks arrived."""
        now = time.monotonic()
        with self._lock:
            for i, (io, t0) in list(self._pending.items()):
                if i not in self._copying and now > t0 + (io.wait_s or 0.0) + self.grace_s:
                    del self._pending[i]
                    self._record(io, t0, 0, now)
            out, self._outcomes = self._outcomes, []
        return out

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            tickets = [self._fetch(io) for _, io, _ in batch]
            for (i, io, t0), ticket in zip(batch, tickets):
                self._finish(i, io, t0, ticket)

    def _fetch(self, io: BlockIO) -> int | None:
        try:
            return self.link.call(lambda c: c.fetch(io.keys))
        except TierKVError as exc:
            self._warn("an asynchronous load (vLLM recomputes its blocks)", exc)
            return None

    def _finish(self, i: int, io: BlockIO, t0: float, ticket: int | None) -> None:
        """Wait for the ticket within the request's bound, copy what arrived, report the request."""
        client = self.link.get() if ticket is not None else None
        if client is None or ticket is None:
            self._report(i, io, t0, None)
            return
        left = max(0.0, t0 + (io.wait_s or 0.0) - time.monotonic())
        try:
            with client.wait(ticket, timeout=left) as lease:
                self._report(i, io, t0, lease)
        except TierKVError as exc:
            self.link.drop(exc)
            self._warn("an asynchronous load (vLLM recomputes its blocks)", exc)
            self._report(i, io, t0, None)
        except Exception as exc:  # noqa: BLE001 - the thread must report every request it took
            self._warn("an asynchronous load (vLLM recomputes its blocks)", exc)
            self._report(i, io, t0, None)

    def _report(self, i: int, io: BlockIO, t0: float, lease: Any) -> None:
        """Copy the leased blocks into vLLM's pages (unless the request was given up) and report it. The
        copy runs outside the lock, so the step's :meth:`take` never waits for it; a request being
        copied is never given up."""
        with self._lock:
            if i not in self._pending:
                return  # given up by take(): its blocks were reported failed, vLLM recomputes them
            self._copying.add(i)
        n = 0
        if lease is not None and lease.count:
            n = lease.count
            try:
                self._scatter(lease.views, io.block_ids[:n])
            except Exception as exc:  # noqa: BLE001 - report the request whatever happened
                self._warn("an asynchronous load (vLLM recomputes its blocks)", exc)
                n = 0
        with self._lock:
            self._copying.discard(i)
            del self._pending[i]
            self._record(io, t0, n, time.monotonic())

    def _scatter(self, views: Sequence[torch.Tensor], block_ids: Sequence[int]) -> None:
        if self._stream is None:
            self.pages.scatter(views, block_ids)
            return
        with torch.cuda.stream(self._stream):
            self.pages.scatter(views, block_ids)
            self._stream.synchronize()

    def _record(self, io: BlockIO, t0: float, n: int, now: float) -> None:
        """Lock held."""
        self._outcomes.append(Outcome(io, n, now - t0))

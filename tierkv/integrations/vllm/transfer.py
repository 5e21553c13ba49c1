"""The worker side of the vLLM connector as plain code: loads before or beside the forward pass, one
store pass after it, through tierkv's zero-copy slots.

Loads lease the blocks in the daemon's shared host pool and copy them straight into vLLM's pages;
stores gather vLLM's pages straight into freshly allocated slots and commit them. A block that is
missing, evicted or unreadable when its load runs is reported to vLLM, which recomputes it: a load
never serves wrong data and never fails a request.

Asynchronous loads (prefixes partly on disk) run on a thread of their own with its own connection:
each is fetched (the daemon promotes its blocks), waited for up to its bound, copied into vLLM's pages
and reported done; the step that reports it also reports the blocks that did not arrive. A store
never waits for room: a host tier with no block to spare skips the store and counts it.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from tierkv.client.client import Client
from tierkv.core.errors import TierFull, TierKVError
from tierkv.integrations.vllm.committer import StoreCommitter
from tierkv.integrations.vllm.link import Link
from tierkv.integrations.vllm.pages import VllmPages
from tierkv.integrations.vllm.plan import BlockIO

log = logging.getLogger("vllm.tierkv")

__all__ = ["AsyncLoads", "Counters", "Transfers"]

WARN_EVERY_S = 60.0  # a failing store or load is logged at most this often (the counters count each)


@dataclass(slots=True)
class Counters:
    """What the connector did since the counters were last taken (summed across workers by vLLM)."""

    hit_tokens: int = 0          # tokens served from tierkv into vLLM
    stored_tokens: int = 0       # tokens of blocks handed to tierkv
    new_blocks: int = 0          # of those, blocks tierkv did not hold yet
    load_s: float = 0.0          # inside steps (synchronous loads)
    store_s: float = 0.0         # inside steps
    load_errors: int = 0         # blocks vLLM recomputes
    store_errors: int = 0        # blocks not stored (daemon absent or failing)
    store_skipped: int = 0       # blocks not stored: the host tier had no room to spare at once
    store_steps: int = 0         # steps that stored something
    store_max_s: float = 0.0     # the longest store pass of one step (kept as a maximum, not summed)
    async_loads: int = 0         # requests loaded beside the forward pass
    async_hit_tokens: int = 0    # of ``hit_tokens``, served by asynchronous loads
    async_wait_s: float = 0.0    # their summed time from submission to done

    def as_dict(self) -> dict[str, float]:
        """The counters as a plain dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def add(self, other: dict[str, float]) -> None:
        """Add another worker's or interval's counters (maxima stay maxima)."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), other.get(f.name, 0)
            setattr(self, f.name, max(mine, theirs) if f.name.endswith("_max_s") else mine + theirs)


class Transfers:
    """Loads and stores of one vLLM worker.

    Args:
        link: the connection to the daemon (this worker's namespace).
        pages: the worker's paged caches.
        async_link: a second connection, for loads beside the forward pass (None: they run in the step).
        committer: commits stores behind the step (None: within it).
        remote: in-step commits return once written through to the daemon's remote tier (a producer's).
    """

    def __init__(self, link: Link, pages: VllmPages, async_link: Link | None = None,
                 committer: StoreCommitter | None = None, remote: bool = False) -> None:
        self.link = link
        self.pages = pages
        self.committer = committer
        self.remote = remote
        self.counters = Counters()
        self._errors: set[int] = set()
        self._warned: dict[str, float] = {}
        self.asyncs = AsyncLoads(async_link, pages, self._warn) if async_link is not None else None
        self._done_now: set[str] = set()

    def _warn(self, what: str, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._warned.get(what, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._warned[what] = now
            log.warning("tierkv: %s failed (%s); later failures in the next %.0f s are only counted",
                        what, exc, WARN_EVERY_S)

    def load(self, loads: Sequence[BlockIO]) -> None:
        """Copy each request's blocks from tierkv into vLLM's pages; blocks that cannot be loaded are
        remembered for :meth:`take_load_errors`."""
        if not loads:
            return
        t0 = time.perf_counter()
        for io in loads:
            try:
                n = self.link.call(functools.partial(self._load_one, io=io))
            except TierKVError as exc:
                self._warn("a load (vLLM recomputes its blocks)", exc)
                n = None
            n = n or 0
            self._fail(io.block_ids[n:])
            self.counters.hit_tokens += n * self.pages.layout.block_tokens
        self.counters.load_s += time.perf_counter() - t0

    def _load_one(self, client: Client, io: BlockIO) -> int:
        with client.acquire(io.keys) as lease:
            n = lease.count
            self.pages.scatter(lease.views, io.block_ids[:n])
            self.pages.synchronize()  # done reading before the lease ends
        return n

    def _fail(self, block_ids: Sequence[int]) -> None:
        self._errors.update(block_ids)
        self.counters.load_errors += len(block_ids)

    def store(self, stores: Sequence[BlockIO]) -> None:
        """Gather the step's new full blocks of every request into tierkv slots and commit them. With a
        committer the step costs the copy into slots allocated ahead (commits run on its thread);
        without one, the copy and two round trips. Never a wait for room."""
        keys = [k for io in stores for k in io.keys]
        if not keys:
            return
        ids = [b for io in stores for b in io.block_ids]
        chains, at = [], 0  # each request's blocks continue its own chain
        for io in stores:
            if io.keys:
                chains.append((at, io.parent))
                at += len(io.keys)
        # token ids for the daemon's KV events, when every request of the step has them
        tokens = np.frombuffer(b"".join(io.tokens for io in stores if io.keys and io.tokens is not None),
                               dtype="<i4") \
            if all(io.tokens is not None for io in stores if io.keys) else None
        t0 = time.perf_counter()
        new: int | None = None
        try:
            if self.committer is not None:
                self._store_behind(keys, ids, chains, tokens)
            else:
                new = self.link.call(lambda c: self._store(c, keys, ids, chains, tokens))
                if new is None:
                    self.counters.store_errors += len(keys)
        except TierFull:
            self.counters.store_skipped += len(keys)
        except TierKVError as exc:
            self._warn("a store", exc)
            self.counters.store_errors += len(keys)
        dt = time.perf_counter() - t0
        self.counters.store_s += dt
        self.counters.store_steps += 1
        self.counters.store_max_s = max(self.counters.store_max_s, dt)
        if new is not None:
            self.counters.new_blocks += new
            self.counters.stored_tokens += len(keys) * self.pages.layout.block_tokens

    def _store_behind(self, keys: list[bytes], ids: list[int], chains: list[tuple[int, bytes | None]],
                      tokens: np.ndarray | None) -> None:
        """Copy into the committer's slots (its own connection); it commits them on its own thread."""
        assert self.committer is not None
        link = self.committer.link
        client = link.get()
        if client is None:
            self.counters.store_errors += len(keys)
            return
        try:
            slots = self.committer.slots(client, len(keys))
        except TierKVError as exc:
            if not isinstance(exc, TierFull):
                link.drop(exc)
            raise
        try:
            self.pages.gather(ids, slots.views)
        except BaseException:
            slots.abort()
            raise
        ready = None
        if self.pages.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.pages.device))
        self.committer.submit(client, keys, slots, ready, chains, tokens)

    def _store(self, client: Client, keys: list[bytes], ids: list[int], chains: list[tuple[int, bytes | None]],
               tokens: np.ndarray | None) -> int:
        with client.alloc(len(keys), timeout=0) as slots:
            self.pages.gather(ids, slots.views)
            self.pages.synchronize()
            return slots.commit(keys, chains=chains, remote=self.remote, tokens=tokens)

    def start_async(self, loads: Sequence[BlockIO]) -> None:
        """Start loads that run beside the forward pass; :meth:`take_done` reports them."""
        for io in loads:
            if self.asyncs is None:  # no second connection: load now, in the step
                self.load([io])
                self._done_now.add(io.req_id)
            else:
                self.asyncs.submit(io)

    def take_done(self) -> set[str]:
        """Requests whose asynchronous loads finished since the last call; their blocks that did not
        arrive join :meth:`take_load_errors` (vLLM must see both in the same step)."""
        done, self._done_now = self._done_now, set()
        if self.asyncs is not None:
            ids, failed, counters = self.asyncs.take()
            done |= ids
            self._errors.update(failed)
            self.counters.load_errors += len(failed)
            self.counters.hit_tokens += counters.hit_tokens
            self.counters.async_hit_tokens += counters.hit_tokens
            self.counters.async_loads += counters.async_loads
            self.counters.async_wait_s += counters.async_wait_s
        return done

    def take_load_errors(self) -> set[int]:
        """vLLM block ids whose load failed since the last call."""
        errors, self._errors = self._errors, set()
        return errors

    def take_counters(self) -> Counters:
        """The counters since the last call (and start new ones), the committer's included."""
        c, self.counters = self.counters, Counters()
        if self.committer is not None:
            done = self.committer.take()
            c.stored_tokens += done.stored_tokens
            c.new_blocks += done.new_blocks
            c.store_errors += done.store_errors
            c.store_skipped += done.store_skipped
        return c


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
        self._next_id = 0
        self._done: set[str] = set()
        self._failed: set[int] = set()
        self._counters = Counters()
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

    def take(self) -> tuple[set[str], set[int], Counters]:
        """(requests done, their blocks that did not arrive, counters) since the last call; requests
        past their bound and grace are given up here, all their blocks failed."""
        now = time.monotonic()
        with self._lock:
            for i, (io, t0) in list(self._pending.items()):
                if now > t0 + (io.wait_s or 0.0) + self.grace_s:
                    del self._pending[i]
                    self._record(io, t0, 0, now)
            out = self._done, self._failed, self._counters
            self._done, self._failed, self._counters = set(), set(), Counters()
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
        copy runs under the lock, so :meth:`take` never gives up a request whose pages are being
        written."""
        with self._lock:
            if self._pending.pop(i, None) is None:
                return  # given up by take(): its blocks were reported failed, vLLM recomputes them
            n = 0
            if lease is not None and lease.count:
                n = lease.count
                try:
                    self._scatter(lease.views, io.block_ids[:n])
                except Exception as exc:  # noqa: BLE001 - report the request whatever happened
                    self._warn("an asynchronous load (vLLM recomputes its blocks)", exc)
                    n = 0
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
        self._done.add(io.req_id)
        self._failed.update(io.block_ids[n:])
        self._counters.hit_tokens += n * self.pages.layout.block_tokens
        self._counters.async_loads += 1
        self._counters.async_wait_s += now - t0

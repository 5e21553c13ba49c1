"""The worker side of the vLLM connector as plain code: loads before or beside the forward pass, one
store pass after it, through tierkv's zero-copy slots.

Loads lease the blocks in the daemon's shared host pool and copy them straight into vLLM's pages;
stores gather vLLM's pages straight into freshly allocated slots and commit them, only for the blocks
tierkv does not hold yet (:mod:`~tierkv.integrations.vllm.missing`). A block that is
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
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from tierkv.client.client import Client
from tierkv.client.slots import Slots
from tierkv.core.errors import ConnectionFailed, TierFull, TierKVError
from tierkv.integrations.vllm.asyncload import AsyncLoads, Outcome
from tierkv.integrations.vllm.blockio import BlockIO
from tierkv.integrations.vllm.committer import StoreCommitter
from tierkv.integrations.vllm.link import Link
from tierkv.integrations.vllm.missing import Missing, missing
from tierkv.integrations.vllm.pages import VllmPages

log = logging.getLogger("vllm.tierkv")

__all__ = ["AsyncLoads", "Counters", "Staged", "Transfers"]

WARN_EVERY_S = 60.0  # a failing store or load is logged at most this often (the counters count each)


@dataclass(slots=True)
class Counters:
    """What the connector did since the counters were last taken (summed across workers by vLLM)."""

    hit_tokens: int = 0          # tokens served from tierkv into vLLM
    stored_tokens: int = 0       # tokens of blocks handed to tierkv
    new_blocks: int = 0          # of those, blocks tierkv did not hold yet
    store_deduplicated: int = 0  # blocks not handed over: tierkv held them (not copied; a use each)
    load_s: float = 0.0          # inside steps (synchronous loads)
    load_steps: int = 0          # steps that loaded something inside the step
    load_max_s: float = 0.0      # the longest load of one step (kept as a maximum, not summed)
    store_s: float = 0.0         # inside steps
    store_copy_s: float = 0.0    # of which copying vLLM's pages into slots
    load_errors: int = 0         # blocks vLLM recomputes
    store_errors: int = 0        # blocks not stored (daemon absent or failing)
    store_skipped: int = 0       # blocks not stored: the host tier had no room to spare at once
    store_steps: int = 0         # steps that stored something
    store_max_s: float = 0.0     # the longest store pass of one step (kept as a maximum, not summed)
    unidentified_requests: int = 0  # neither stored nor loaded: an input could not be identified (scheduler)
    store_offered: int = 0       # new blocks offered to the daemon's store gate (scheduler)
    store_gated: int = 0         # of those, not stored: unlikely to be read back (scheduler)
    store_idle: int = 0          # of those, stored after their request ended, the engine idle (scheduler)
    async_loads: int = 0         # requests loaded beside the forward pass
    async_hit_tokens: int = 0    # of ``hit_tokens``, served by asynchronous loads
    async_wait_s: float = 0.0    # their summed time from submission to done
    load_bytes: int = 0          # bytes copied from tierkv into vLLM's pages
    window_saved_bytes: int = 0  # bytes of served blocks a sliding window never reads: not moved at all

    def as_dict(self) -> dict[str, float]:
        """The counters as a plain dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def add(self, other: dict[str, float]) -> None:
        """Add another worker's or interval's counters (maxima stay maxima)."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), other.get(f.name, 0)
            setattr(self, f.name, max(mine, theirs) if f.name.endswith("_max_s") else mine + theirs)


@dataclass(slots=True)
class Staged:
    """A store gathered into slots and not committed yet."""

    client: Client
    slots: Slots
    keys: list[bytes]
    chains: list[tuple[int, bytes | None]]
    tokens: np.ndarray | None
    t0: float
    uses: list[bytes]
    tenants: list[tuple[int, str | None]]


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

    def _short(self, o: Outcome) -> None:
        """Log an asynchronous load that ended short (rate-limited like the warnings)."""
        now = time.monotonic()
        if now - self._warned.get("short", -WARN_EVERY_S) >= WARN_EVERY_S:
            self._warned["short"] = now
            log.info("tierkv: an asynchronous load of %d blocks ended after %.2f s (bound %.2f s) with %d "
                     "arrived; vLLM recomputes the rest", len(o.io.keys), o.seconds, o.io.wait_s or 0.0,
                     o.arrived)

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
            self.count_load(self.counters, io, n)
        took = time.perf_counter() - t0
        self.counters.load_s += took
        self.counters.load_steps += 1
        self.counters.load_max_s = max(self.counters.load_max_s, took)

    def count_load(self, counters: Counters, io: BlockIO, arrived: int) -> int:
        """Add a load of which ``arrived`` blocks arrived to ``counters``; returns the tokens it served
        (a sliding window's blocks before ``io.keys`` count once the window arrived whole)."""
        lo = self.pages.layout
        counters.load_bytes += arrived * lo.block_bytes
        served = arrived + (io.lead if arrived == len(io.block_ids) else 0)
        if arrived == len(io.block_ids):
            counters.window_saved_bytes += io.lead * lo.block_bytes
        counters.hit_tokens += served * lo.block_tokens
        return served * lo.block_tokens

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
        staged = self.stage(stores)
        if staged is not None:
            self.commit(staged)

    def stage(self, stores: Sequence[BlockIO]) -> Staged | None:
        """Take slots for the stores' blocks that tierkv does not hold (from the committer's reservoir
        when there is one) and gather vLLM's pages into them; nothing is committed yet. None: nothing
        to store, or no slots (counted)."""
        total = sum(len(io.keys) for io in stores)
        if not total:
            return None
        t0 = time.perf_counter()
        link = self.committer.link if self.committer is not None else self.link
        client = link.get()
        todo = Missing()
        try:
            if client is None:
                raise ConnectionFailed("daemon not reachable")
            todo = missing(stores, client.cached)
            slots = self._slots(client, todo)
            t1 = time.perf_counter()
            try:
                self.pages.gather(todo.block_ids, slots.views)
                self.counters.store_copy_s += time.perf_counter() - t1
            except BaseException:
                slots.abort()
                raise
        except TierFull:
            self.counters.store_skipped += len(todo.keys)
            self.counters.store_deduplicated += todo.skipped
        except TierKVError as exc:
            if client is not None:
                link.drop(exc)
                self._warn("a store", exc)
            self.counters.store_errors += total
        else:
            self.counters.store_deduplicated += todo.skipped
            return Staged(client, slots, todo.keys, todo.chains, todo.tokens, t0, todo.uses, todo.tenants)
        self._timed(t0)
        return None

    def _slots(self, client: Client, todo: Missing) -> Slots:
        """Slots for ``todo``'s blocks, evicting none of the cached blocks it skips."""
        if self.committer is not None:
            return self.committer.slots(client, len(todo.keys), keep=todo.uses)
        if not todo.keys:
            return Slots(client, [])
        return client.alloc(len(todo.keys), timeout=0, keep=todo.uses)

    def commit(self, staged: Staged) -> None:
        """Commit staged blocks (and the uses of the cached ones skipped): on the committer's thread
        once the copy is done, or now."""
        st, n = staged, len(staged.keys)
        if self.committer is not None:
            ready = None
            if n and self.pages.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.pages.device))
            self.committer.submit(st.client, st.keys, st.slots, ready, st.chains, st.tokens, st.uses, st.tenants)
            self._timed(st.t0)
            return
        try:
            if n:
                self.pages.synchronize()
            new = st.slots.commit(st.keys, chains=st.chains, remote=self.remote, tokens=st.tokens, uses=st.uses,
                                  tenants=st.tenants)
        except TierKVError as exc:
            self._warn("a store", exc)
            self.link.drop(exc)
            self.counters.store_errors += n
        else:
            self.counters.new_blocks += new
            self.counters.stored_tokens += n * self.pages.layout.block_tokens
        self._timed(st.t0)

    def abort(self, staged: Staged) -> None:
        """Give staged slots back uncommitted (another group of the same blocks found no room)."""
        try:
            staged.slots.abort()
        except TierKVError:
            pass  # the connection is gone, and its slots with it
        self.counters.store_skipped += len(staged.keys)
        self._timed(staged.t0)

    def _timed(self, t0: float) -> None:
        dt = time.perf_counter() - t0
        self.counters.store_s += dt
        self.counters.store_steps += 1
        self.counters.store_max_s = max(self.counters.store_max_s, dt)

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
        for o in self.take_outcomes():
            done.add(o.io.req_id)
            failed = o.io.block_ids[o.arrived:]
            if failed:
                self._short(o)
            self._errors.update(failed)
            self.counters.load_errors += len(failed)
            self.counters.async_hit_tokens += self.count_load(self.counters, o.io, o.arrived)
            self.counters.async_loads += 1
            self.counters.async_wait_s += o.seconds
        return done

    def take_outcomes(self) -> list[Outcome]:
        """The asynchronous loads finished since the last call, not counted yet."""
        return self.asyncs.take() if self.asyncs is not None else []

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

"""The worker side of the vLLM connector as plain code: one load pass before the forward pass and one
store pass after it, through tierkv's zero-copy slots.

Loads lease the blocks in the daemon's shared host pool and copy them straight into vLLM's pages;
stores gather vLLM's pages straight into freshly allocated slots and commit them. A block that is
missing, evicted or unreadable when its load runs is reported to vLLM, which recomputes it: a load
never serves wrong data and never fails a request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields

from tierkv.client.client import Client
from tierkv.core.errors import TierKVError
from tierkv.integrations.vllm.link import Link
from tierkv.integrations.vllm.pages import VllmPages
from tierkv.integrations.vllm.plan import BlockIO

log = logging.getLogger("vllm.tierkv")

__all__ = ["Counters", "Transfers"]

WARN_EVERY_S = 60.0  # a failing store or load is logged at most this often (the counters count each)


@dataclass(slots=True)
class Counters:
    """What the connector did since the counters were last taken (summed across workers by vLLM)."""

    hit_tokens: int = 0          # tokens served from tierkv into vLLM
    stored_tokens: int = 0       # tokens of blocks handed to tierkv
    new_blocks: int = 0          # of those, blocks tierkv did not hold yet
    load_s: float = 0.0
    store_s: float = 0.0
    load_errors: int = 0         # blocks vLLM recomputes
    store_errors: int = 0        # blocks not stored (daemon absent or full)

    def as_dict(self) -> dict[str, float]:
        """The counters as a plain dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def add(self, other: dict[str, float]) -> None:
        """Add another worker's counters."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + other.get(f.name, 0))


class Transfers:
    """Loads and stores of one vLLM worker.

    Args:
        link: the connection to the daemon (this worker's namespace).
        pages: the worker's paged caches.
    """

    def __init__(self, link: Link, pages: VllmPages) -> None:
        self.link = link
        self.pages = pages
        self.counters = Counters()
        self._errors: set[int] = set()
        self._warned: dict[str, float] = {}

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
                n = self.link.call(lambda c, io=io: self._load_one(c, io))
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
        """Gather the step's new full blocks of every request into tierkv slots and commit them."""
        keys = [k for io in stores for k in io.keys]
        if not keys:
            return
        ids = [b for io in stores for b in io.block_ids]
        t0 = time.perf_counter()
        try:
            new = self.link.call(lambda c: self._store(c, keys, ids))
        except TierKVError as exc:
            self._warn("a store", exc)
            new = None
        if new is None:
            self.counters.store_errors += len(keys)
            return
        self.counters.new_blocks += new
        self.counters.stored_tokens += len(keys) * self.pages.layout.block_tokens
        self.counters.store_s += time.perf_counter() - t0

    def _store(self, client: Client, keys: list[bytes], ids: list[int]) -> int:
        with client.alloc(len(keys)) as slots:
            self.pages.gather(ids, slots.views)
            self.pages.synchronize()
            return slots.commit(keys)

    def take_load_errors(self) -> set[int]:
        """vLLM block ids whose load failed since the last call."""
        errors, self._errors = self._errors, set()
        return errors

    def take_counters(self) -> Counters:
        """The counters since the last call (and start new ones)."""
        c, self.counters = self.counters, Counters()
        return c

"""The scheduler side of the vLLM connector as plain code: which blocks a request loads from tierkv,
whether the load runs inside the step or beside it, and which blocks each step stores.

A prefix all in host memory loads inside the step (one copy). One that is partly on disk or in the
remote tier loads asynchronously: the daemon starts promoting it at once, vLLM parks the request
(``WAITING_FOR_REMOTE_KVS``) and runs others, and the worker reports the request when its blocks are in
vLLM's pages, or when the bound runs out (what arrived is used, vLLM recomputes the rest). The bound
is the time recomputing the same tokens would take, by the daemon's cost model, so a load never makes
a request wait longer than not having the cache would.

It knows vLLM only through a few attributes (a request's ``request_id``, ``all_token_ids``,
``num_tokens``, ``cache_salt``; a scheduler output's new and cached requests), does no I/O of its
own, and asks the daemon through a :class:`~tierkv.integrations.vllm.link.Link`: ``lookup`` answers
from the daemon's shared lookup index, so the scheduling hot path makes no round trip.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tierkv.core.errors import TierKVError
from tierkv.core.keys import KEY_BYTES, Namespace, chain_keys
from tierkv.integrations.vllm.link import Link

__all__ = ["BlockIO", "Planner", "PrefillMeter", "StepPlan", "salt_root"]

ASYNC_WAIT_MIN_S = 0.5   # the least an asynchronous load may take (a disk read of a few blocks)
ASYNC_WAIT_MAX_S = 30.0  # the most, whatever the cost model says


def salt_root(fingerprint: bytes, salt: str | None) -> bytes | None:
    """The parent key a request's chain starts from: None (the shared root) without a salt, else a
    digest of the salt under the namespace, so tenants with different salts share no key."""
    if not salt:
        return None
    return hashlib.blake2b(b"tierkv/cache_salt|" + salt.encode(), digest_size=KEY_BYTES,
                           key=fingerprint).digest()


@dataclass(slots=True)
class BlockIO:
    """Blocks of one request to move between tierkv (``keys``) and vLLM (``block_ids``).

    ``wait_s`` marks an asynchronous load: the most seconds it may take before what arrived is used and
    the rest recomputed (None: a load inside the step, or a store). ``parent``: the key ``keys[0]``
    continues in its request's chain (None: the chain's first block). ``tokens``: a store's token ids
    (int32 bytes, ``block_tokens`` per key), for the daemon's KV events."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    wait_s: float | None = None
    parent: bytes | None = None
    tokens: bytes | None = None


@dataclass(slots=True)
class StepPlan:
    """What the worker does in one step: loads before the forward pass, stores after it."""

    loads: list[BlockIO] = field(default_factory=list)
    stores: list[BlockIO] = field(default_factory=list)


@dataclass(slots=True)
class _Request:
    request: Any
    root: bytes | None
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    cached_blocks: int = 0        # leading blocks known to be in tierkv
    stored_blocks: int = 0        # leading blocks stored or found in tierkv
    load_from: int = 0            # first block of a pending load
    load: BlockIO | None = None
    wait_s: float | None = None   # the pending load is asynchronous, bounded by this
    waited: bool = False          # an asynchronous load was sent: the request never waits twice


@dataclass(frozen=True, slots=True)
class Role:
    """What a ``kv_role`` does with tierkv: whether it stores, whether its stores commit before the
    step ends (a producer's prompt must be in tierkv when its response reaches the proxy that sends the
    request on to a consumer), and whether those commits wait for the write-through to the daemon's
    remote tier (a consumer on another node, whose daemon shares it, finds the whole prompt). Every
    role loads: tierkv is a cache, and a lost block is a recompute."""

    stores: bool = True
    commit_in_step: bool = False
    write_through: bool = False

    @classmethod
    def of(cls, kv_role: str | None) -> Role:
        """``kv_both`` (or unset): stores committed behind the step; ``kv_producer``: stores committed
        within it, written through to the remote tier (if the daemon has one) before the commit
        returns; ``kv_consumer``: never stores.

        Raises:
            ValueError: another role.
        """
        if kv_role in (None, "kv_both"):
            return cls()
        if kv_role == "kv_producer":
            return cls(commit_in_step=True, write_through=True)
        if kv_role == "kv_consumer":
            return cls(stores=False)
        raise ValueError(f"kv_role must be kv_both, kv_producer or kv_consumer, got {kv_role!r}")


class Planner:
    """Per-request bookkeeping of the scheduler-side connector.

    Args:
        link: the connection to the daemon.
        namespace: the namespace of the blocks (its fingerprint seeds every key).
        block_tokens: vLLM's block size, also tierkv's block size.
        stores: plan stores (False for a ``kv_consumer``, which only loads).
    """

    def __init__(self, link: Link, namespace: Namespace, block_tokens: int, stores: bool = True) -> None:
        self.link = link
        self.stores = stores
        self.fingerprint = namespace.fingerprint
        self.block_tokens = block_tokens
        self._reqs: dict[str, _Request] = {}
        self._parked: list[BlockIO] = []  # asynchronous loads of requests vLLM does not schedule yet

    def _state(self, request: Any) -> _Request:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = _Request(request, salt_root(self.fingerprint, getattr(request, "cache_salt", None)))
            self._reqs[request.request_id] = st
        return st

    def _keys(self, st: _Request, n_blocks: int) -> list[bytes]:
        """The first ``n_blocks`` chained keys of the request's tokens (extended as tokens arrive)."""
        have = len(st.keys)
        if n_blocks > have:
            bt = self.block_tokens
            tokens = st.request.all_token_ids[have * bt:n_blocks * bt]
            st.keys.extend(chain_keys(self.fingerprint, list(tokens), bt, st.keys[-1] if st.keys else st.root))
        return st.keys[:n_blocks]

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` that tierkv can load (whole blocks; at least one token
        of the request is always left to compute), and whether the load is asynchronous (part of the
        prefix is not in host memory: the daemon starts bringing it up now)."""
        st = self._state(request)
        st.load, st.wait_s = None, None
        bt = self.block_tokens
        if num_computed_tokens % bt:
            return 0, False
        keys = self._keys(st, (request.num_tokens - 1) // bt)
        if not keys:
            return 0, False
        first = num_computed_tokens // bt
        try:
            hit = self.link.call(lambda c: c.lookup(keys)) or 0
            plan = self.link.call(lambda c: c.lookup_plan(keys[:hit])) if hit > first else None
        except TierKVError as exc:
            self.link.drop(exc)
            return 0, False
        st.cached_blocks = max(st.cached_blocks, hit)
        if plan is None:
            return 0, False
        local = int(plan["count"])
        # the cost model weighs the local tiers; a prefix that goes on in the remote tier loads whole
        n = min(int(plan["fetch"]), hit) if int(plan["fetch"]) < local else hit
        if n <= first:
            return 0, False
        st.load_from = first
        ready = list(plan["ready"]) + [False] * (n - local)  # remote blocks are never ready
        if st.waited:  # its asynchronous load ended short: load what is in host memory now, if any
            n = next((i for i in range(first, n) if not ready[i]), n)
            if n <= first:
                return 0, False
        elif not all(ready[first:n]):
            st.wait_s = _wait_bound(plan, n)
            try:
                self.link.call(lambda c: c.prefetch(keys[:n]))
            except TierKVError as exc:
                self.link.drop(exc)
                return 0, False
        return n * bt - num_computed_tokens, st.wait_s is not None

    def queued(self, request: Any) -> int:
        """A request entered vLLM's queue: start promoting its cached prefix's disk blocks into host
        memory now (the daemon bounds what prefetches may hold); returns loads started."""
        st = self._state(request)
        keys = self._keys(st, (request.num_tokens - 1) // self.block_tokens)
        if not keys:
            return 0
        try:
            hit = self.link.call(lambda c: c.lookup(keys)) or 0
            return (self.link.call(lambda c: c.prefetch(keys[:hit])) or 0) if hit else 0
        except TierKVError as exc:
            self.link.drop(exc)
            return 0

    def allocated(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM gave the request ``block_ids`` (all of its blocks); plan the load of the external tokens."""
        st = self._state(request)
        st.block_ids = list(block_ids)
        if num_external_tokens <= 0:
            return
        first, n = st.load_from, num_external_tokens // self.block_tokens
        st.load = BlockIO(request.request_id, st.keys[first:first + n], st.block_ids[first:first + n], st.wait_s)
        if st.wait_s is not None:  # vLLM parks the request: the load goes out with the next step
            self._parked.append(st.load)
            st.load, st.waited = None, True

    def step(self, scheduler_output: Any) -> StepPlan:
        """The loads and stores of one scheduled step."""
        plan = StepPlan(loads=self._parked)
        self._parked = []
        counts = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = list(new.block_ids[0])
                self._plan_request(st, new.num_computed_tokens + counts.get(new.req_id, 0), plan)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            self._plan_request(st, cached.num_computed_tokens[i] + counts.get(req_id, 0), plan)
        return plan

    def _plan_request(self, st: _Request, tokens_after_step: int, plan: StepPlan) -> None:
        if st.load is not None:
            plan.loads.append(st.load)
            st.load = None
        st.stored_blocks = max(st.stored_blocks, st.cached_blocks)
        full = min(tokens_after_step, st.request.num_tokens) // self.block_tokens
        full = min(full, len(st.block_ids))
        if full > st.stored_blocks and self.stores:
            keys = self._keys(st, full)
            lo = st.stored_blocks
            ids = st.request.all_token_ids[lo * self.block_tokens:full * self.block_tokens]
            plan.stores.append(BlockIO(st.request.request_id, keys[lo:full], st.block_ids[lo:full],
                                       parent=keys[lo - 1] if lo else st.root,
                                       tokens=np.asarray(ids, dtype="<i4").tobytes()))
            st.stored_blocks = full

    def finished(self, request: Any) -> list[bytes]:
        """Forget a finished request and tell the daemon its blocks are a conversation tail that a next
        turn may extend, with how many tokens it generated; returns the keys of its stored blocks."""
        st = self._reqs.pop(request.request_id, None)
        keys = [] if st is None else st.keys[:st.stored_blocks]
        out = getattr(request, "num_output_tokens", None)
        out = out if isinstance(out, int) and not isinstance(out, bool) and out >= 0 else None
        if keys:
            try:
                self.link.call(lambda c: c.request_finished(keys, out))
            except TierKVError:  # a hint (an older daemon may not know it): losing it costs no request
                pass
        return keys

    def __len__(self) -> int:
        return len(self._reqs)


def _wait_bound(plan: dict[str, Any], n: int) -> float:
    """How long an asynchronous load of the first ``n`` blocks may take: the seconds recomputing them
    would cost (the daemon's cost model; blocks past the plan's runs, in the remote tier, at the runs'
    mean), within the fixed floor and ceiling."""
    runs = plan.get("runs", [])
    blocks = sum(int(r["blocks"]) for r in runs)
    per_block = sum(float(r["recompute_s"]) for r in runs) / blocks if blocks else 0.0
    recompute, counted = 0.0, 0
    for run in runs:
        take = min(int(run["blocks"]), n - counted)
        if take <= 0:
            break
        recompute += float(run["recompute_s"]) * take / int(run["blocks"])
        counted += take
    recompute += per_block * max(0, n - counted)
    return min(ASYNC_WAIT_MAX_S, max(ASYNC_WAIT_MIN_S, recompute))


class PrefillMeter:
    """The engine's prefill speed, seen from the scheduler: tokens of each step over the time to the next
    step, for steps whose requests carry on into the next (no idle gap), reported to the daemon's cost
    model every ``every_s`` seconds.

    Args:
        report: called with (tokens, seconds) summed since the last report.
        min_tokens: steps with fewer scheduled tokens (decode steps) are left out.
        every_s: seconds between reports.
        clock: time source.
    """

    def __init__(self, report: Callable[[int, float], object], min_tokens: int = 256, every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.report, self.min_tokens, self.every_s, self.clock = report, min_tokens, every_s, clock
        self._last: tuple[float, int, set[str]] | None = None
        self._tokens, self._seconds = 0, 0.0
        self._next = clock() + every_s

    def step(self, scheduled: dict[str, int]) -> None:
        """One step was scheduled with ``scheduled`` tokens per request id."""
        now = self.clock()
        last = self._last
        if last is not None and last[1] >= self.min_tokens and last[2] & scheduled.keys():
            self._tokens += last[1]
            self._seconds += now - last[0]
        self._last = (now, sum(scheduled.values()), set(scheduled))
        if now >= self._next and self._tokens and self._seconds > 0:
            tokens, seconds = self._tokens, self._seconds
            self._tokens, self._seconds = 0, 0.0
            self._next = now + self.every_s
            self.report(tokens, seconds)

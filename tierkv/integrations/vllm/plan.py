"""The scheduler side of the vLLM connector as plain code: which blocks a request loads from tierkv,
whether the load runs inside the step or beside it, and which blocks each step stores.

A prefix all in host memory loads inside the step (one copy), unless it is longer than
``sync_load_blocks``. One that is partly on disk or in the remote tier, or that long, loads
asynchronously: the daemon starts promoting it at once, vLLM parks the request
(``WAITING_FOR_REMOTE_KVS``) and runs others, and the worker reports the request when its blocks are in
vLLM's pages, or when the bound runs out (what arrived is used, vLLM recomputes the rest). The bound
is the time recomputing the same tokens would take, by the daemon's cost model, so a load never makes
a request wait longer than not having the cache would (until the engine's prefill speed is measured,
a fixed ceiling).

It knows vLLM only through a few attributes (a request's ``request_id``, ``all_token_ids``,
``num_tokens``, ``cache_salt``; a scheduler output's new and cached requests), does no I/O of its
own, and asks the daemon through a :class:`~tierkv.integrations.vllm.link.Link`: ``lookup`` answers
from the daemon's shared lookup index, so the scheduling hot path makes no round trip.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from tierkv.core.errors import TierKVError
from tierkv.core.keys import Namespace, chain_keys
from tierkv.integrations.vllm.blockio import BlockIO, StepPlan, tenant_of
from tierkv.integrations.vllm.groups import GroupSpec, find_hit
from tierkv.integrations.vllm.idle import IdleStores
from tierkv.integrations.vllm.inputs import Inputs, TokensOnly, salt_root
from tierkv.integrations.vllm.link import Link
from tierkv.integrations.vllm.meter import PrefillMeter, wait_bound
from tierkv.integrations.vllm.offers import StoreOffers
from tierkv.integrations.vllm.ranks import ask_ranks, finished, merge_plans

log = logging.getLogger("vllm.tierkv")

__all__ = ["BlockIO", "PlanGroup", "Planner", "PrefillMeter", "StepPlan"]


@dataclass(slots=True)
class _Request:
    request: Any
    roots: list[bytes | None]
    keys: list[list[bytes]]       # per group
    block_ids: list[list[int]]    # per group
    cached_blocks: int = 0        # leading blocks known to be in tierkv
    stored_blocks: int = 0        # leading blocks stored or found in tierkv
    load_from: int = 0            # first block of a pending load
    load: list[BlockIO] | None = None  # a pending load, one per group
    wait_s: float | None = None   # the pending load is asynchronous, bounded by this
    waited: bool = False          # an asynchronous load was sent: the request never waits twice
    inputs: Inputs | None = None  # None: an input cannot be identified; neither stored nor loaded
    cut_at: int | None = None     # where the store gate stopped storing this request (None: it did not)
    idle_to: int = 0              # blocks cut_at .. idle_to - 1 are stored if the engine is idle at its end

    @property
    def cut(self) -> bool:
        """The store gate stopped storing this request (its chain is broken at ``cut_at``)."""
        return self.cut_at is not None


@dataclass(frozen=True, slots=True)
class PlanGroup:
    """One KV cache group as the scheduler side sees it: the connection to its namespace (tensor-parallel
    rank 0's), the namespace, its spec (None: full attention), and the connections to the other ranks'
    namespaces of the group (ranks 1 .. tp_size - 1; keys are rank 0's chain in every rank's namespace)."""

    link: Link
    namespace: Namespace
    spec: GroupSpec | None = None
    ranks: tuple[Link, ...] = ()

    @property
    def links(self) -> tuple[Link, ...]:
        """Every rank's connection, in rank order."""
        return (self.link, *self.ranks)


class Planner:
    """Per-request bookkeeping of the scheduler-side connector.

    With tensor parallelism a block counts as cached, and as ready in host memory, only where every rank
    holds it (:mod:`~tierkv.integrations.vllm.ranks`). With several KV cache groups a block position is
    loaded only when every group can serve it
    (:func:`~tierkv.integrations.vllm.groups.find_hit`) and stored for every group or for none. With
    several groups or a sliding window every load is asynchronous: vLLM takes load failures of such
    models per request (a block id names no position in another group, and a window's recompute needs
    the blocks before it, which vLLM has freed).

    Args:
        groups: the KV cache groups, in vLLM's order.
        block_tokens: vLLM's block size, also tierkv's block size.
        stores: plan stores (False for a ``kv_consumer``, which only loads).
        null_block: vLLM's null block id (a sliding-window group's blocks outside the window).
        sync_load_blocks: the most blocks a prefix in host memory copies inside the step; a longer one
            loads beside it, so its copy does not stall the batch's decode (None: every one inside).
        meter: the engine's prefill speed as this scheduler measured it, for loads' bounds while the
            daemon knows none (a daemon just restarted).
        identify: a request's inputs besides its token ids; raises ``ValueError`` when one cannot be
            identified (the request is then neither stored nor loaded). Default: token ids alone.
        gate: ask the daemon's store gate, once per step, which of the step's new blocks are worth
            storing (:mod:`tierkv.cache.store_gate`); a request stores a leading run of its blocks and
            nothing after the first one the gate skips, and after it ends the run the gate keeps for an
            idle engine, in a step with no request to run (:mod:`~tierkv.integrations.vllm.idle`).
    """

    def __init__(self, groups: Sequence[PlanGroup], block_tokens: int, stores: bool = True,
                 null_block: int = 0, sync_load_blocks: int | None = None,
                 meter: PrefillMeter | None = None, identify: Callable[[Any], Inputs] | None = None,
                 gate: bool = False) -> None:
        if not groups:
            raise ValueError("a planner needs at least one KV cache group")
        self.groups = list(groups)
        self.link = self.groups[0].link
        self.stores = stores
        self.fingerprint = self.groups[0].namespace.fingerprint
        self.block_tokens = block_tokens
        self.null_block = null_block
        self.sync_load_blocks = sync_load_blocks
        self.meter = meter
        self._specs = [g.spec or GroupSpec(i, "full", g.namespace.layout, ()) for i, g in enumerate(self.groups)]
        self._windowed = any(s.reach is not None for s in self._specs)
        self.whole_requests = len(self.groups) > 1 or self._windowed  # loads fail per request, never per block
        self._reqs: dict[str, _Request] = {}
        self._parked: list[BlockIO] = []  # asynchronous loads of requests vLLM does not schedule yet
        self._identify = identify or (lambda request: TokensOnly())
        self.unidentified = 0  # requests neither stored nor loaded: an input could not be identified
        self._why_unidentified: set[str] = set()  # each reason is logged once
        self.offers = StoreOffers(self.link, block_tokens) if gate else None
        self.idle = IdleStores()  # runs of finished requests stored when the engine is idle

    @classmethod
    def single(cls, link: Link, namespace: Namespace, block_tokens: int, stores: bool = True) -> Planner:
        """A planner for a model with one full-attention KV cache group."""
        return cls([PlanGroup(link, namespace)], block_tokens, stores)

    def _state(self, request: Any) -> _Request:
        st = self._reqs.get(request.request_id)
        if st is None:
            salt = getattr(request, "cache_salt", None)
            n = len(self.groups)
            try:
                inputs: Inputs | None = self._identify(request)
            except ValueError as exc:
                inputs = None
                self.unidentified += 1
                if str(exc) not in self._why_unidentified:
                    self._why_unidentified.add(str(exc))
                    log.warning("tierkv: requests with an input tierkv cannot identify are neither stored nor "
                                "loaded (%s)", exc)
            adapter = inputs.adapter if inputs is not None else None
            st = _Request(request, [salt_root(g.namespace.fingerprint, salt, adapter) for g in self.groups],
                          [[] for _ in range(n)], [[] for _ in range(n)], inputs=inputs)
            self._reqs[request.request_id] = st
        return st

    def _keys(self, st: _Request, n_blocks: int) -> list[list[bytes]]:
        """Per group, the first ``n_blocks`` chained keys of the request's tokens and other inputs
        (extended as tokens arrive)."""
        have = len(st.keys[0])
        if n_blocks > have and st.inputs is not None:
            bt = self.block_tokens
            tokens = list(st.request.all_token_ids[have * bt:n_blocks * bt])
            extras = st.inputs.extras(have, n_blocks)
            for g, keys in enumerate(st.keys):
                fp = self.groups[g].namespace.fingerprint
                keys.extend(chain_keys(fp, tokens, bt, keys[-1] if keys else st.roots[g], extras))
        return [keys[:n_blocks] for keys in st.keys]

    def _ask(self, g: int, fn: Callable[..., Any]) -> list[Any] | None:
        """``fn(client)`` on every rank's connection of group ``g``; None when the daemon cannot answer
        for some rank (a failed connection is dropped and made again later)."""
        return ask_ranks(self.groups[g].links, fn)

    def _hit(self, keys: list[list[bytes]], first: int, limit: int) -> int:
        """Leading blocks every group can serve, each on every rank (see :func:`find_hit`); a group the
        daemon does not answer for serves none."""
        def lookup(g: int) -> Callable[[int, int], int]:
            return lambda lo, hi: min(map(int, self._ask(g, lambda c: c.lookup(keys[g][lo:hi])) or [0]))
        return find_hit(self._specs, [lookup(g) for g in range(len(self.groups))], first, limit)

    def _start(self, g: int, first: int, n: int) -> int:
        """The first block of a hit of ``n`` blocks that group ``g`` needs from tierkv: 0 for full
        attention (its prefix is looked up whole), ``first`` or later in a sliding window."""
        spec = self._specs[g]
        return 0 if spec.reach is None else max(first, spec.first_needed(n))

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` that tierkv can load (whole blocks; at least one token
        of the request is always left to compute), and whether the load is asynchronous (part of the
        prefix is not in host memory, or the model has several KV cache groups)."""
        st = self._state(request)
        st.load, st.wait_s = None, None
        bt = self.block_tokens
        if num_computed_tokens % bt or st.inputs is None:
            return 0, False
        limit = (request.num_tokens - 1) // bt
        keys = self._keys(st, limit)
        if not limit:
            return 0, False
        first = num_computed_tokens // bt
        hit = self._hit(keys, first, limit)
        if hit <= first and self._windowed:  # nothing to load: what tierkv holds from the start
            hit = self._hit(keys, 0, limit)
        st.cached_blocks = max(st.cached_blocks, hit)
        n = self._plan_load(st, keys, first, hit) if hit > first else 0
        if n <= first:
            st.wait_s = None
            return 0, False
        st.load_from = first
        return n * bt - num_computed_tokens, st.wait_s is not None

    def _plan_load(self, st: _Request, keys: list[list[bytes]], first: int, hit: int) -> int:
        """How many leading blocks to load (``first`` or less: none), and whether asynchronously (sets
        ``st.wait_s``; the daemon starts promoting what is not in host memory)."""
        starts = [self._start(g, first, hit) for g in range(len(self.groups))]
        asked = [self._ask(g, lambda c, g=g: c.lookup_plan(keys[g][starts[g]:hit])) for g in range(len(self.groups))]
        if any(p is None for p in asked):
            return 0
        plans = [merge_plans(p) for p in asked if p is not None]
        if self.whole_requests:
            if st.waited:  # its asynchronous load ended short: vLLM recomputes
                return 0
            n = hit
            ready = all(int(p["count"]) >= n - s and all(p["ready"][max(s, first) - s:n - s])
                        for s, p in zip(starts, plans))
        else:
            plan, local = plans[0], int(plans[0]["count"])
            # the cost model weighs the local tiers; a prefix that goes on in the remote tier loads whole
            n = min(int(plan["fetch"]), hit) if int(plan["fetch"]) < local else hit
            if n <= first:
                return 0
            flags = list(plan["ready"]) + [False] * (n - local)  # remote blocks are never ready
            if st.waited:  # its asynchronous load ended short: load what is in host memory now, if any
                return next((i for i in range(first, n) if not flags[i]), n)
            # a long copy from host memory goes beside the step too: inside, every request would wait for it
            ready = all(flags[first:n]) and (self.sync_load_blocks is None or n - first <= self.sync_load_blocks)
        if not ready or self.whole_requests:
            # recomputing the load's blocks: a prefix from block 0, a window's from ``first``
            rate = self.meter.tokens_per_s() if self.meter is not None else None
            st.wait_s = wait_bound(plans[0], n if starts[0] == 0 else n - first, self.block_tokens, rate)
            for g in range(len(self.groups)):
                if self._ask(g, lambda c, g=g: c.prefetch(keys[g][max(starts[g], first):n])) is None:
                    return 0
        return n

    def queued(self, request: Any) -> int:
        """A request entered vLLM's queue: start promoting its cached prefix's disk blocks into host
        memory now (the daemon bounds what prefetches may hold); returns loads started."""
        st = self._state(request)
        if st.inputs is None:
            return 0
        limit = (request.num_tokens - 1) // self.block_tokens
        keys = self._keys(st, limit)
        hit = self._hit(keys, 0, limit) if limit else 0
        return sum(sum(self._ask(g, lambda c, g=g: c.prefetch(keys[g][self._start(g, 0, hit):hit])) or [0])
                   for g in range(len(self.groups))) if hit else 0

    def allocated(self, request: Any, block_ids: Sequence[Sequence[int]], num_external_tokens: int) -> None:
        """vLLM gave the request ``block_ids`` (all of its blocks, one list per group); plan the load of the
        external tokens."""
        st = self._state(request)
        st.block_ids = [list(ids) for ids in block_ids]
        if num_external_tokens <= 0:
            return
        first = st.load_from
        n = first + num_external_tokens // self.block_tokens
        st.load = [self._load_io(st, g, first, n) for g in range(len(self.groups))]
        if st.wait_s is not None:  # vLLM parks the request: the load goes out with the next step
            self._parked.extend(st.load)
            st.load, st.waited = None, True

    def _load_io(self, st: _Request, g: int, first: int, n: int) -> BlockIO:
        """Group ``g``'s part of a load of blocks ``first .. n - 1``: the blocks vLLM gave it a page for
        (a sliding-window group's trailing run; its null block stands before)."""
        ids = st.block_ids[g]
        n = min(n, len(ids))
        lo = min(max(first, self._specs[g].first_needed(n)), n)
        if self._specs[g].reach is not None:  # only a sliding window's blocks may be the null block
            while lo > first and ids[lo - 1] != self.null_block:
                lo -= 1  # vLLM kept a block the window formula does not need: load it too
            while lo < n and ids[lo] == self.null_block:
                lo += 1
        return BlockIO(st.request.request_id, st.keys[g][lo:n], ids[lo:n], st.wait_s, group=g, lead=lo - first)

    def step(self, scheduler_output: Any) -> StepPlan:
        """The loads and stores of one scheduled step."""
        plan = StepPlan(loads=self._parked)
        self._parked = []
        counts = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = [list(ids) for ids in new.block_ids]
                self._plan_request(st, new.num_computed_tokens + counts.get(new.req_id, 0), plan)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = [list(ids) for ids in new_ids] if new_ids is not None else \
                    [[] for _ in self.groups]
            elif new_ids is not None:
                for have, more in zip(st.block_ids, new_ids):
                    have.extend(more)
            self._plan_request(st, cached.num_computed_tokens[i] + counts.get(req_id, 0), plan)
        if self.offers is not None and plan.stores:
            plan.stores = self.offers.trim(plan.stores, self._reqs)
        idle_stores, plan.release = self.idle.take(idle=not self._reqs)
        plan.stores.extend(idle_stores)
        return plan


    def _plan_request(self, st: _Request, tokens_after_step: int, plan: StepPlan) -> None:
        if st.load is not None:
            plan.loads.extend(st.load)
            st.load = None
        if st.inputs is None:
            return
        st.stored_blocks = max(st.stored_blocks, st.cached_blocks)
        full = min(tokens_after_step, st.request.num_tokens) // self.block_tokens
        full = min([full] + [len(ids) for ids in st.block_ids])
        lo = st.stored_blocks
        # a position is stored for every group or none: not where a group has no page (outside its window)
        while lo < full and any(ids[lo] == self.null_block for ids in self._windowed_ids(st)):
            lo += 1
        if full > lo and self.stores:
            plan.stores.extend(self._store_ios(st, lo, full))
            st.stored_blocks = full

    def _store_ios(self, st: _Request, lo: int, hi: int) -> list[BlockIO]:
        """Every group's store of the request's blocks ``lo .. hi - 1``."""
        bt = self.block_tokens
        tokens = np.asarray(st.request.all_token_ids[lo * bt:hi * bt], dtype="<i4").tobytes()
        tenant = tenant_of(getattr(st.request, "cache_salt", None))
        return [BlockIO(st.request.request_id, gkeys[lo:hi], st.block_ids[g][lo:hi],
                        parent=gkeys[lo - 1] if lo else st.roots[g], tokens=tokens, group=g, first=lo, tenant=tenant)
                for g, gkeys in enumerate(self._keys(st, hi))]

    def _windowed_ids(self, st: _Request) -> list[list[int]]:
        """The block ids of the request's sliding-window groups (the only ones with null blocks)."""
        return [ids for ids, spec in zip(st.block_ids, self._specs) if spec.reach is not None]

    def finished(self, request: Any) -> list[bytes]:
        """Forget a finished request and tell the daemon its blocks are a conversation tail that a next
        turn may extend, with how many tokens it generated; returns the keys of the blocks it offered (the
        first group's). The run the gate kept for an idle engine is stored by a later step with no
        request to run: :meth:`holds` says whether vLLM must keep the request's pages until then."""
        st = self._reqs.pop(request.request_id, None)
        out = getattr(request, "num_output_tokens", None)
        out = out if isinstance(out, int) and not isinstance(out, bool) and out >= 0 else None
        if st is None:
            return []
        self._store_when_idle(st)
        for g, group in enumerate(self.groups):
            keys = st.keys[g][:st.stored_blocks]
            for link in group.links if keys else ():
                try:
                    link.call(partial(finished, keys=keys, out=out))
                except TierKVError:  # a hint (an older daemon may not know it): losing it costs no request
                    pass
        return st.keys[0][:st.stored_blocks]

    def _store_when_idle(self, st: _Request) -> None:
        """Hand a finished request's idle run to :attr:`idle` (not for sliding windows, whose early pages
        vLLM has freed)."""
        lo, hi = st.cut_at, min(st.idle_to, st.stored_blocks, *(len(ids) for ids in st.block_ids))
        if lo is None or hi <= lo or self._windowed or st.inputs is None:
            return
        self.idle.finished(st.request.request_id, self._store_ios(st, lo, hi), idle=not self._reqs)

    def holds(self, request_id: str) -> bool:
        """Whether vLLM must keep a finished request's pages: a later step stores from them."""
        return self.idle.holds(request_id)

    def __len__(self) -> int:
        return len(self._reqs)


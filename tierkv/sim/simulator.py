"""The replay loop: a workload through one eviction policy per tier, on the trace's clock.

The model, per request in timestamp order:

1. Lookup: the longest prefix of pages present in any tier hits; each hit is served by the tier it
   is in. Pages after the first miss are recomputed even if cached (prefix semantics).
2. Hits in a lower tier are promoted into the first tier (bytes moved ``lower->first``); an
   inclusive tier (the daemon's disk) keeps its copy. Misses are computed and inserted into the
   first tier. Every page of the request is protected (leased) while room is made.
3. Making room: the tier's policy picks victims (all or nothing); a victim with a copy further
   down just leaves, the others are written to the next tier if its admission rule
   (:class:`~tierkv.cache.admission.Admission`) takes them, else dropped. The rule is told how often
   a victim was used since it was cached (a request naming it while a tier held it), as the daemon
   tells it its blocks' hits.
4. Time to first token: ``max(recompute time of the missed tokens, load time of the hit bytes)``
   (loads overlap layer-wise with compute); recompute cost per token grows with its position.
5. The request finishes: its pages are a chain tail until a later request extends the chain (the
   engine's ``request_finished`` signal with the trace's output length, fed to the same reuse models
   as in the daemon).

With ``quotas`` (per tenant, bytes per tier) the tiers decide as the daemon's managers do with the same
:class:`~tierkv.cache.quotas.Quotas`: a page belongs to the tenant of the request that stored it (a
trace line's ``tenant``), a tenant over its quota gives up its own pages first, and one within it keeps
its pages against the others' floods; each tenant's token hit rate is reported.

With ``store_gate = "predicted"`` the pages after the hit are first offered to the daemon's store gate
(:class:`~tierkv.cache.store_gate.StoreGate`), as an engine's connector offers them: only the leading
run it keeps is stored (and used); the rest is recomputed and forgotten, but for the run the gate keeps
for an idle engine: stored when the first request that ends with the engine idle ends (its own, or a
later one's; the engine runs requests one after another, each for its prefill at
``prefill_tokens_per_s``, and is idle at a request's end when the next arrives after it; decode is not
modelled, nor the room vLLM's own cache has to hold the pages until then).
Served pages teach it as the daemon's reads do.

The policies and admission rules are wired as the daemon wires them (:mod:`tierkv.cache.wiring`), on
the trace's clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from tierkv.cache import wiring
from tierkv.cache.admission import Admission
from tierkv.cache.clock import DrivenClock
from tierkv.cache.policy import Policy, policy_class
from tierkv.cache.policy.attention import AttentionPolicy
from tierkv.cache.quotas import Quotas
from tierkv.cache.reuse import History
from tierkv.cache.store_gate import BlockCosts, StoreGate
from tierkv.core.units import parse_capacity
from tierkv.sim.result import ReplayResult, percentile
from tierkv.sim.spec import ReplayConfig, TierSpec
from tierkv.sim.stack import TierStack
from tierkv.sim.workload import Workload, prefill_seconds


class Simulator:
    """Replays a :class:`Workload` through one policy per tier.

    Args:
        workload: the expanded trace.
        policy: a registered policy name (``opt`` for Belady's oracle).
        config: tiers and cost model.
    """

    def __init__(self, workload: Workload, policy: str, config: ReplayConfig) -> None:
        if workload.page_tokens != config.page_tokens:
            raise ValueError("workload and config disagree on page_tokens")
        self.w, self.config, self.policy_name = workload, config, policy
        self.clock = DrivenClock()
        page_bytes = config.page_bytes
        unique_bytes = workload.unique_pages * page_bytes
        self.caps = [parse_capacity(str(t.capacity), unique_bytes) if not isinstance(t.capacity, int)
                     else t.capacity for t in config.tiers]
        self.sizes = [max(1, int(round(page_bytes / max(t.compression, 1e-9)))) for t in config.tiers]
        self.history = History(max_entries=max(1 << 16, 4 * workload.unique_pages))
        self._next_of: dict[int, float] = {}
        self._recompute: dict[int, float] | None = None
        names = [t.policy or policy for t in config.tiers]
        # the first tier's attention policy weighs blocks by their learned chance of a return, as
        # the daemon's host tier does
        self.host_reuse = wiring.host_reuse(max(1 << 16, 4 * workload.unique_pages)) \
            if names[0] in ("attention", "adaptive") else None
        if "default" in names:
            raise ValueError("policy 'default' needs each tier's policy (TierSpec.policy; the CLI reads "
                             "them from configs/default.toml)")
        self.rules: list[Admission | None] = [self._make_rule(i) for i in range(len(config.tiers))]
        self.policies = [self._make_policy(name, i) for i, name in enumerate(names)]
        self.parent_of: dict[int, int] = {}  # page -> previous page of its prefix
        self.hits: dict[int, int] = {}  # page -> uses since it was cached (the reused rule reads them)
        self._writer_free = [0.0] * len(config.tiers)  # trace time each tier's writer is done
        self._hit_tok = 0
        self._idle_run: list[int] = []  # the request's pages stored if the engine is idle at its end
        self._held: list[list[int]] = []  # idle runs of requests that ended beside others, oldest first
        self.idle_stored = 0
        self.ended_idle: list[bool] = []  # per request replayed: no other request waited when it ended
        # the engine's signals reach the models a decision reads: predicted rules and the host's reuse
        self._signals: list[Any] = [r for r in self.rules if r is not None and r.mode == "predicted"]
        if self.host_reuse is not None:
            self._signals.append(self.host_reuse)
        modes = [t.admission_mode for t in config.tiers[1:]]
        self.admission_name = ",".join(modes) if modes else "none"
        self.gate = StoreGate(config.store_gate, **config.store_gate_settings)
        self._costs = BlockCosts(self._page_recompute_s, page_bytes / config.store_cost_bytes_per_s)
        self.placement_name = ",".join(f"{t.name}={n}" for t, n in zip(config.tiers, names))
        self.quotas = Quotas()
        for tenant, limits in config.quotas.items():
            self.quotas.set(tenant, dict(limits), {})
        self.tenant_of: dict[int, str] = {}  # page -> the tenant whose request stored it
        self._tenant: str | None = None  # the request being served's

    def _make_rule(self, tier: int) -> Admission | None:
        """The admission rule of tier ``tier`` (None for the first tier), as the daemon builds its disk's
        (:func:`tierkv.cache.wiring.admission_rule`): the models remember the tier's capacity in blocks
        of departures unless ``admission_settings`` say otherwise."""
        if tier == 0:
            return None
        rule = wiring.admission_rule(self.config.tiers[tier].admission_mode, self.config.admission_settings,
                                     ghost_entries=max(16, self.caps[tier] // max(self.sizes[tier], 1)),
                                     max_records=max(1 << 16, 4 * self.w.unique_pages), unit=self.history.branch)
        rule.resize(self.caps[tier])
        return rule

    def _page_recompute_s(self, position: int) -> float:
        """Seconds recomputing the page ``position`` pages into a prompt costs (the store gate's cost)."""
        cfg = self.config
        start = position * cfg.page_tokens
        return prefill_seconds(start, start + cfg.page_tokens, cfg.prefill_tokens_per_s, cfg.attn_double_tokens)

    def _page_cost_fn(self, tier: int) -> Callable[[int, int], float]:
        """``cost_fn`` for tier ``tier``: seconds to need a page again once it left the tier."""
        cfg, w = self.config, self.w
        if self._recompute is None:
            cost: dict[int, float] = {}
            for pages, toks in zip(w.pages, w.tokens):
                pos = 0
                for p, tk in zip(pages, toks):
                    if p not in cost:
                        cost[p] = prefill_seconds(pos, pos + tk, cfg.prefill_tokens_per_s, cfg.attn_double_tokens)
                    pos += tk
            self._recompute = cost
        cost = self._recompute
        below = cfg.tiers[tier + 1] if tier + 1 < len(cfg.tiers) else None

        def fn(key: int, size: int) -> float:
            c = cost[key]
            if below is not None and below.read_bytes_per_s > 0:
                c = min(c, cfg.page_bytes / below.read_bytes_per_s + below.latency_s)
            return c
        return fn

    def _make_policy(self, name: str, tier: int) -> Policy:
        """Tier ``tier``'s policy through the daemon's wiring (:mod:`tierkv.cache.wiring`), on the trace's
        clock, with what the simulator knows of the trace (page costs, the oracle's next uses)."""
        cfg = self.config
        settings = dict(cfg.policy_settings.get(name, {}))
        hooks: dict[str, Any] = {}
        if name == "opt":
            hooks["next_use"] = self._next_of.__getitem__
        elif issubclass(policy_class(name), AttentionPolicy):
            if cfg.page_costs:
                hooks["cost_fn"] = self._page_cost_fn(tier)
            settings.setdefault("block_tokens", cfg.page_tokens)
            settings.setdefault("prefill_tokens_per_s", cfg.prefill_tokens_per_s)
            settings.setdefault("attn_double_tokens", cfg.attn_double_tokens)
            if tier + 1 < len(cfg.tiers):
                below = cfg.tiers[tier + 1]
                settings.setdefault("fetch_bytes_per_s", below.read_bytes_per_s)
                settings.setdefault("fetch_latency_s", below.latency_s)
        overrides = cfg.tiers[tier].policy_settings
        rule = self.rules[tier]
        if rule is None:
            return wiring.host_policy(name, settings, overrides, clock=self.clock, history=self.history,
                                      reuse=self.host_reuse, **hooks)
        # fed by the first tier's misses, as the daemon's disk
        return wiring.colder_policy(name, settings, overrides, evict_model=rule.evict_model, mode=rule.mode,
                                    clock=self.clock, history=self.history, **hooks)

    def run(self, capacity_label: str | None = None) -> ReplayResult:
        """Replay the whole workload and return its figures."""
        t0, c0 = time.perf_counter(), time.process_time()
        w, cfg, clock = self.w, self.config, self.clock
        tiers = cfg.tiers
        stack = self.stack = TierStack([t.name for t in tiers], self.caps, self.sizes,
                                       [t.inclusive for t in tiers], self.policies, cfg.page_bytes,
                                       self._admit, self.parent_of, self._left, self.quotas, self.tenant_of)
        hit_tokens = [0] * len(tiers)
        tenant_tokens: dict[str, list[int]] = {}  # tenant -> [hit tokens, prompt tokens]
        total_tokens = 0
        ttft: list[float] = []
        ttft_ref: list[float] = []
        next_use = w.next_use if self.policy_name == "opt" else None
        rate, dbl = cfg.prefill_tokens_per_s, cfg.attn_double_tokens
        busy_until = 0.0  # trace time the engine ends the requests so far
        for i, req in enumerate(w.requests):
            clock.now = req.timestamp_s
            pages, toks = w.pages[i], w.tokens[i]
            if next_use is not None:
                for p, nu in zip(pages, next_use[i]):
                    self._next_of[p] = nu
            total_tokens += req.input_tokens
            self._tenant = req.tenant
            load_b = self._serve(pages, toks, hit_tokens)
            if req.tenant is not None:
                tt = tenant_tokens.setdefault(req.tenant, [0, 0])
                tt[0] += self._hit_tok
                tt[1] += req.input_tokens
            compute = prefill_seconds(self._hit_tok, req.input_tokens, rate, dbl)
            ttft.append(max(compute, self._load_seconds(load_b)))
            ttft_ref.append(prefill_seconds(0, req.input_tokens, rate, dbl))
            busy_until = max(busy_until, req.timestamp_s) + ttft[-1]
            for rule in self._signals:
                rule.request_finished(pages, clock.now, req.output_tokens if req.output_given else None)
            self.ended_idle.append(i + 1 == len(w.requests) or w.requests[i + 1].timestamp_s >= busy_until)
            if self._idle_run:
                self._held.append(self._idle_run)
            if self.ended_idle[-1]:
                for run in self._held:
                    self._store(run)
                    self.idle_stored += len(run)
                self._held = []
        total = max(total_tokens, 1)
        label = capacity_label if capacity_label is not None else str(tiers[0].capacity)
        return ReplayResult(
            policy=self.policy_name, capacity=label, capacity_bytes=self.caps[0], requests=len(w.requests),
            input_tokens=total_tokens, token_hit_rate=sum(hit_tokens) / total,
            tier_hit_rate={tiers[t].name: hit_tokens[t] / total for t in range(len(tiers))},
            bytes_moved=stack.c.moved, disk_writes_bytes=stack.c.disk_writes, dropped_bytes=stack.c.dropped_bytes,
            ttft_mean_s=sum(ttft) / max(len(ttft), 1), ttft_p50_s=percentile(ttft, 0.5), ttft_p99_s=percentile(ttft, 0.99),
            ttft_recompute_p50_s=percentile(ttft_ref, 0.5), ttft_recompute_p99_s=percentile(ttft_ref, 0.99),
            wall_s=time.perf_counter() - t0, cpu_s=time.process_time() - c0, placement=self.placement_name,
            admission=self.admission_name, store_offered=self.gate.c.offered, store_skipped=self.gate.c.skipped,
            store_idle=self.idle_stored,
            tenant_hit_rate={t: h / max(n, 1) for t, (h, n) in sorted(tenant_tokens.items())})

    def _serve(self, pages: list[int], toks: list[int], hit_tokens: list[int]) -> list[int]:
        """One request: count its prefix hits, promote cached pages and insert the rest into tier 0.
        Returns the bytes read per tier."""
        stack = self.stack
        held = stack.held
        load_b = [0] * stack.n
        k, n = 0, len(pages)
        while k < n and pages[k] in held:
            t = stack.fastest(pages[k])
            assert t is not None  # the page is held
            hit_tokens[t] += toks[k]
            load_b[t] += stack.page_bytes
            k += 1
        self._hit_tok = sum(toks[:k])
        self._idle_run = []
        if self.gate.mode != "all":
            for p in pages[:k]:
                self.gate.read(p)
            if k < n:  # the missed pages are offered to the store gate: the run it keeps is stored
                now_n, idle_n = self.gate.decide(None, pages[k:], k, self._costs)
                self._idle_run = pages[k + now_n:k + idle_n]
                if self._idle_run and k + now_n:
                    self.parent_of[self._idle_run[0]] = pages[k + now_n - 1]  # the chain it continues
                n = k + now_n
                pages, toks = pages[:n], toks[:n]
        self._store(pages)
        return load_b

    def _store(self, pages: list[int]) -> None:
        """Pages of a request go into tier 0: cached ones are promoted or used, the others computed and
        stored."""
        stack, now, n = self.stack, self.clock.now, len(pages)
        for rule in self._signals:
            rule.requested(pages, now)
        for j in range(1, n):
            self.parent_of[pages[j]] = pages[j - 1]
        incoming: list[int] = []
        hits = self.hits
        for p in pages:
            t = stack.fastest(p)
            if t is None:
                hits.pop(p, None)  # computed: cached afresh
                if self._tenant is None:
                    self.tenant_of.pop(p, None)
                else:
                    self.tenant_of[p] = self._tenant
            else:
                hits[p] = hits.get(p, 0) + 1  # a use of a cached page (the daemon's lease)
            if t == 0:
                stack.use(p)
                continue
            if t is not None:
                stack.promote(p, t)
            incoming.append(p)
        stack.insert0(incoming, set(pages))
        for pol in self.policies[1:]:  # what the first tier did not hold: the lower tiers' references
            for p in incoming:
                pol.referenced(p, self.parent_of.get(p))

    def _load_seconds(self, load_b: list[int]) -> float:
        load = 0.0
        for t, spec in enumerate(self.config.tiers):
            if load_b[t]:
                if spec.read_bytes_per_s > 0:  # read into the compute device
                    load += load_b[t] / spec.read_bytes_per_s
                    self.stack.c.move(spec.name, "gpu", load_b[t])
                load += spec.latency_s
        return load

    def _left(self, page: int, tier: int) -> None:
        if tier == 0 and self.host_reuse is not None:
            self.host_reuse.left(page, self.clock.now, len(self.policies[0]))
        below = tier + 1
        rule = self.rules[below] if below < len(self.rules) else None
        if rule is not None and self.stack.held[page] >> below:  # a copy below: not offered to the rule
            rule.departed(page, self.sizes[below], True)

    def _admit(self, page: int, tier: int) -> bool:
        """Whether a victim of tier ``tier - 1`` is written into ``tier``: the rule decides, told whether
        the tier's writer has spare bandwidth (nothing queued), as the daemon's writer tells it."""
        rule, now = self.rules[tier], self.clock.now
        bw = self.config.tiers[tier].write_bytes_per_s
        ok = rule is None or rule.admit(page, now, hits=self.hits.get(page, 0),
                                        spare=bw > 0 and self._writer_free[tier] <= now, size=self.sizes[tier])
        if ok and bw > 0:
            self._writer_free[tier] = max(self._writer_free[tier], now) + self.sizes[tier] / bw
        return ok


def replay(workload: Workload, policy: str, config: ReplayConfig,
           capacity_label: str | None = None) -> ReplayResult:
    """Run one policy over ``workload``; see :class:`Simulator`."""
    return Simulator(workload, policy, config).run(capacity_label)


def sweep(workload: Workload, policies: Sequence[str], capacities: Sequence[str], config: ReplayConfig,
          progress: Callable[[ReplayResult], None] | None = None,
          per_policy: Callable[[str, ReplayConfig], ReplayConfig] | None = None) -> list[ReplayResult]:
    """Every policy at every first-tier capacity (OPT is added as the ceiling if missing).

    ``per_policy(name, config)`` may return the config one policy runs with (its tiers' policies and
    admission rules); the first tier's capacity is set afterwards.
    """
    names = list(dict.fromkeys([*policies, "opt"]))
    out = []
    for cap in capacities:
        for name in names:
            base = per_policy(name, config) if per_policy is not None else config
            tiers = [TierSpec(**{**asdict(base.tiers[0]), "capacity": cap}), *base.tiers[1:]]
            cfg = ReplayConfig(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, "tiers": tiers})
            res = replay(workload, name, cfg, cap)
            out.append(res)
            if progress:
                progress(res)
    return out


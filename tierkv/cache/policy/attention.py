"""The default policy: reuse heat, sharing, miss cost, size and attention in one priority.

For block ``b`` resident in this tier (higher stays longer)::

    F  = F * 2^(-dt/half_life_s) + 1            on every use (recency and frequency in one number)
    F' = 1 + log2(min(F, freq_cap))             (``freq_shape=log``; ``linear`` uses F itself)
    B  = (uses(b) / uses(parent))^branch_weight a rarely taken branch below a busy prefix (a
                                                per-request suffix) is worth less than the prefix
    R  = 1 + beta * log2(1 + sharers)           live leases + prefix children (``on_sharers``)
    C  = min(fetch_s from the next tier, recompute_s)       or ``cost_fn(key, size)``
         recompute_s = block_tokens / prefill_tokens_per_s * (1 + depth_tokens / attn_double_tokens)
    A  = attention mass reported by ``on_touch``, decayed with ``attn_half_life_s`` (1.0 = uniform)
    P  = reuse(b)^reuse_weight                  the learned chance that the block comes back once
                                                it leaves (``reuse``, a ReuseModel; 1 without one)
    priority = L + (F' * B * R + gamma * A) * P * C / S
    L  = priority of the last block evicted from this tier (GDSF aging clock)

With ``idle_aging`` = k > 0 a block's value halves every ``tau`` seconds it goes unused instead:
``priority = log2(value) + t_scored / tau``, an order that stays put between events, with ``tau`` = k
times a running mean (weight 0.002, start 300 s) of the idle time of the tier's victims, so the
half-life follows how long the tier keeps blocks. When ``tau`` moves by more than a quarter every
resident block is re-scored with it (each keeps its ``log2(value)`` and the time it was scored at).
With a ``reuse`` factor a hand also moves over the resident blocks, eight per victim, and re-scores
(from the time each was scored at) those whose learned chance has moved by a factor of 2 or more
since: a block scored while the model knew little keeps its idle time but not a stale ``P``.
The disk tier's default: its blocks wait minutes for their conversation's next turn, and a
conversation idle for long goes before a busier one whatever their values were.

A block is only a candidate once none of its prefix children is resident in this tier
(``tails_first``): a parent is worth at least its children, so chains shrink from the tail.

With ``shadow_rate`` > 0 the policy never trails plain recency for long: a
:class:`~tierkv.cache.policy.shadow.Shadow` runs this score and LRU side by side on a hash sample of
the branches (:meth:`~tierkv.cache.reuse.history.History.branch`: a sampled branch is seen whole,
so the orders are compared on the prefixes they keep; ``shadow_rate`` of them, at that fraction of
the tier's bytes), and while LRU is the one hitting more there, the tier evicts in LRU order, still
tails first (the score is kept up to date all the while, so it takes over again as soon as it leads).
A tier where the score wins evicts exactly as without it.
Use counts and depths live in a :class:`~tierkv.cache.reuse.history.History` that may be shared by
the policies of all tiers, so heat survives demotion and re-fetch.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

from tierkv.cache.policy.base import Clock, HeapPolicy, Protected, Setting, never, register, walk_victims
from tierkv.cache.policy.chains import walk_tails_in_order
from tierkv.cache.policy.lru import LRUPolicy
from tierkv.cache.policy.shadow import Shadow
from tierkv.cache.reuse.history import History, Record, decayed

_MIB = float(1 << 20)
_IDLE_START_S = 300.0  # idle_aging: the victims' mean idle time before any victim
_TAU_MIN_S = 10.0
_IDLE_WEIGHT = 0.002  # idle_aging: weight of each victim's idle time in the running mean
_TAU_STEP = 0.25  # idle_aging: how far tau moves before every block is re-scored with it
_REFRESH_PER_VICTIM = 8  # idle_aging: blocks the refresh hand checks per victim (a sweep per n/8)


@register
class AttentionPolicy(HeapPolicy):
    """Attention- and cost-aware eviction (the default). See the module docstring for the score.

    Args:
        cost_fn: ``cost_fn(key, size) -> seconds`` to need the block again after it leaves this
            tier (e.g. the store's cost model); overrides the configured figures.
        reuse: ``reuse(key) -> probability`` that the block is requested again once it leaves
            (:meth:`~tierkv.cache.reuse.model.ReuseModel.predictor`); ``None`` leaves it out.
        history: shared use history; a private one is made if ``None``.
        **settings: see ``SETTINGS``.
    """

    name = "attention"
    HOOKS = frozenset({"cost_fn", "history", "reuse"})
    SETTINGS = {
        "half_life_s": Setting(600.0, "seconds for the use frequency F to halve (0 = no decay)", min=0.0),
        "freq_cap": Setting(0.0, "upper bound on F in the score (0 = none)", min=0.0),
        "freq_shape": Setting("log", "how F enters the score: log (1 + log2 F) or linear",
                              choices=("log", "linear")),
        "beta": Setting(0.5, "weight of log2(1 + sharers)", min=0.0),
        "gamma": Setting(1.0, "weight of the attention mass term", min=0.0),
        "attn_half_life_s": Setting(30.0, "seconds for reported attention mass to halve", min=0.0),
        "branch_weight": Setting(0.0, "exponent of count(block) / count(parent): a rarely taken branch "
                                 "below a busy prefix is worth less (0 = off)", min=0.0),
        "tails_first": Setting(True, "only evict blocks with no resident children (parent >= children)"),
        "block_tokens": Setting(16, "tokens per block, for the recompute cost", min=1),
        "prefill_tokens_per_s": Setting(10000.0, "prefill speed used for the recompute cost", min=1e-9),
        "attn_double_tokens": Setting(30000.0,
                                      "context at which a token's prefill cost doubles (0 = flat)", min=0.0),
        "fetch_bytes_per_s": Setting(0.0, "read bandwidth of the next tier (0 = none: recompute)", min=0.0),
        "fetch_latency_s": Setting(0.0, "latency of one read from the next tier", min=0.0),
        "reuse_weight": Setting(1.0, "exponent of the learned chance of a return (0 = off)", min=0.0),
        "idle_aging": Setting(0.0, "half-life of a block's value without a use, as a multiple of the mean "
                              "idle time of the tier's victims (0 = the GDSF aging clock)", min=0.0, max=100.0),
        "shadow_rate": Setting(0.0, "fraction of branches (by hash) on which this score and LRU are simulated side "
                               "by side; the tier evicts in LRU order while LRU hits more there (0 = off)",
                               min=0.0, max=1.0),
        "shadow_window": Setting(20000.0, "sampled references over which the shadow counts hits", min=16.0),
        "shadow_z": Setting(3.0, "standard deviations by which an order's lead in the shadow must pass a "
                            "coin's to take over", min=0.0, max=10.0),
    }

    def __init__(self, *, clock: Clock = time.monotonic, cost_fn: Callable[[Hashable, int], float] | None = None,
                 history: History | None = None, reuse: Callable[[Hashable], float] | None = None,
                 **kwargs: object) -> None:
        self.cost_fn = cost_fn
        self.reuse = reuse
        self.history = history if history is not None else History()
        self._mass: dict[Hashable, tuple[float, float]] = {}  # key -> (mass, time reported)
        self._sharers: dict[Hashable, int] = {}
        self._scored: dict[Hashable, tuple[float, float]] = {}  # key -> (log2 value, time scored)
        self.tau = 0.0  # idle_aging's half-life in seconds (0 = off)
        self._scored_at: float | None = None  # a re-score's scoring time, kept from the last one
        self._p: dict[Hashable, float] = {}  # under idle aging with reuse: the chance a block was scored with
        self._hand: list[Hashable] = []  # the blocks the refresh hand goes over, and where it is
        self._hand_i = 0
        self._idle = _IDLE_START_S
        self._recent: OrderedDict[Hashable, None] = OrderedDict()  # resident blocks, least recently used first
        self._bytes = 0  # recorded sizes of the resident blocks
        self.shadow: Shadow | None = None
        self._shadow_key: tuple[float, float, float] | None = None
        self._counts_uses = True  # False in a shadow's copy: the tier's own policy counts the uses
        # A tier below another sees only part of the uses: its shadow is fed by ``referenced``.
        self.shadow_on_requests = False
        self._ref_size = 1  # the size ``referenced`` gives a key this tier does not hold
        super().__init__(clock=clock, **kwargs)

    def _settings_changed(self) -> None:
        s = self._settings
        self.tails_first = bool(s.number("tails_first"))
        self._make_shadow()
        scored = dict(self._scored) if self.tau else {}  # under idle aging a re-score keeps the idle time
        if not s.number("idle_aging"):
            self.tau, self._idle = 0.0, _IDLE_START_S
            self._scored.clear()
            self._p.clear()
        else:
            self.tau = max(_TAU_MIN_S, s.number("idle_aging") * self._idle)
        for key in self._size:  # weights changed: re-score every resident block
            self._scored_at = scored.get(key, (0.0, None))[1] if self.tau else None
            self._rescore(key)
        self._scored_at = None
        self._compact()

    def _make_shadow(self) -> None:
        """(Re)build the shadow when its settings changed; it starts empty."""
        s = self._settings
        key = (s.number("shadow_rate"), s.number("shadow_window"), s.number("shadow_z"))
        if key == self._shadow_key:
            return
        self._shadow_key = key
        if not s.number("shadow_rate"):
            self.shadow = None
            return
        copy = type(self)(clock=self.clock, cost_fn=self.cost_fn, history=self.history,
                          reuse=self._shadow_reuse, **{**s, "shadow_rate": 0.0})
        copy._counts_uses = False
        self.shadow = Shadow([copy, LRUPolicy(clock=self.clock)], s.number("shadow_rate"), s.number("shadow_window"),
                             s.number("shadow_z"))

    def _shadow_reuse(self, key: Hashable) -> float:
        """The reuse factor the shadow's copy of the score reads: this policy's, whenever it is set."""
        return self.reuse(key) if self.reuse is not None else 1.0

    @property
    def follows_lru(self) -> bool:
        """Whether the tier evicts in LRU order now (its shadow finds LRU hitting more)."""
        return self.shadow is not None and self.shadow.leader == 1

    # -- score ------------------------------------------------------------------------------
    def miss_cost(self, key: Hashable, size: int, rec: Record | None = None) -> float:
        """Seconds it costs to need ``key`` again once it has left this tier."""
        if self.cost_fn is not None:
            return float(self.cost_fn(key, size))
        s = self._settings
        tokens = s.number("block_tokens")
        depth = rec.depth if rec is not None else 0
        recompute = tokens / s.number("prefill_tokens_per_s")
        if s.number("attn_double_tokens") > 0:
            recompute *= 1.0 + (depth + 0.5) * tokens / s.number("attn_double_tokens")
        if s.number("fetch_bytes_per_s") > 0:
            return min(recompute, size / s.number("fetch_bytes_per_s") + s.number("fetch_latency_s"))
        return recompute

    def _rescore(self, key: Hashable) -> None:
        s = self._settings
        now = self.clock() if self._scored_at is None else self._scored_at
        rec = self.history.record(key, now)
        f = decayed(rec, now, s.number("half_life_s"))
        if s.number("freq_cap") > 0:
            f = min(f, s.number("freq_cap"))
        if s.text("freq_shape") == "log":
            f = 1.0 + math.log2(max(f, 1.0))
        extra = 0.0
        mass = self._mass.get(key)
        if mass is not None and s.number("gamma"):
            a, t = mass
            if s.number("attn_half_life_s") > 0:
                a *= 2.0 ** (-max(now - t, 0.0) / s.number("attn_half_life_s"))
            extra = s.number("gamma") * a
        p = 1.0
        if self.reuse is not None:
            raw = self.reuse(key)
            if self.tau:
                self._p[key] = raw
            if s.number("reuse_weight"):
                p = raw ** s.number("reuse_weight")
        size = self._size[key]
        cost = self.miss_cost(key, size, rec) * _MIB / max(size, 1)
        self._set_priority(key, self._combine(key, f, self._branch_sharers(key, rec), extra, p, cost))

    def _branch_sharers(self, key: Hashable, rec: Record) -> tuple[float, float]:
        """The factors ``B`` and ``R`` of the score."""
        s, b, r = self._settings, 1.0, 1.0
        parent = self._parent.get(key)
        if parent is not None and s.number("branch_weight") > 0:
            prec = self.history.get(parent)
            if prec is not None and prec.count > rec.count > 0:
                b = (rec.count / prec.count) ** s.number("branch_weight")
        sharers = self._sharers.get(key, 0)
        if sharers and s.number("beta"):
            r = 1.0 + s.number("beta") * math.log2(1 + sharers)
        return b, r

    def _combine(self, key: Hashable, freq: float, br: tuple[float, float], extra: float, p: float,
                 cost: float) -> float:
        """The priority from the factors of the score: ``L + (F' * B * R + extra) * P * cost``."""
        value = freq
        if br[0] != 1.0:
            value *= br[0]
        if br[1] != 1.0:
            value *= br[1]
        return self._aged(key, self._aging_base(), (value + extra) * p * cost)

    def _aging_base(self) -> float:
        """What a block scored now ages from: the clock under ``idle_aging``, else ``L``."""
        if not self.tau:
            return self.level
        return self.clock() if self._scored_at is None else self._scored_at

    def _aged(self, key: Hashable, base: float, value: float) -> float:
        """The priority of ``value`` scored at ``base`` (see :meth:`_aging_base`)."""
        if not self.tau:
            return base + value
        lv = math.log2(max(value, 1e-300))
        self._scored[key] = (lv, base)
        return lv + base / self.tau

    def _victim_left(self, key: Hashable) -> None:
        """Under ``idle_aging``: fold a victim's idle time into ``tau``; re-score all if it moved."""
        scored = self._scored.get(key)
        if scored is None:
            return
        self._idle += _IDLE_WEIGHT * (self.clock() - scored[1] - self._idle)
        tau = max(_TAU_MIN_S, self._settings.number("idle_aging") * self._idle)
        if abs(tau - self.tau) > _TAU_STEP * self.tau:
            self.tau = tau
            prio = self._prio
            for k, (lv, t) in self._scored.items():
                prio[k] = lv + t / tau
            self._compact()
        if self.reuse is not None:
            self._refresh(_REFRESH_PER_VICTIM)

    def _refresh(self, n: int) -> None:
        """Move the refresh hand over ``n`` resident blocks: re-score, from the time each was scored
        at, those whose learned chance of a return moved by a factor of 2 or more."""
        assert self.reuse is not None  # called only with a reuse model
        if self._hand_i >= len(self._hand):
            self._hand, self._hand_i = list(self._size), 0
        end = min(self._hand_i + n, len(self._hand))
        for key in self._hand[self._hand_i:end]:
            old, scored = self._p.get(key), self._scored.get(key)
            if old is None or scored is None:
                continue  # left the tier since the hand started
            new = self.reuse(key)
            if abs(math.log2(max(new, 1e-300) / max(old, 1e-300))) >= 1.0:
                self._scored_at = scored[1]
                self._rescore(key)
        self._scored_at = None
        self._hand_i = end

    # -- events -----------------------------------------------------------------------------
    def on_insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        self.on_remove(key)
        self._add(key, size, parent)
        self.history.record(key, self.clock(), parent)
        self._rescore(key)

    def on_access(self, key: Hashable) -> None:
        if key in self._size:
            if self._counts_uses:
                self.history.use(key, self.clock(), self._settings.number("half_life_s"))
            self._rescore(key)
            self._recent.move_to_end(key)
            shadow = self.shadow
            if shadow is not None and not self.shadow_on_requests and shadow.sampled(self.history.branch(key)):
                shadow.reference(key, self._size[key], self._parent.get(key))

    def referenced(self, key: Hashable, parent: Hashable | None = None) -> None:
        """With ``shadow_on_requests`` (a tier fed by the misses of the tier above): the shadow's
        references, held here or not. A key this tier does not hold counts the last size it saw."""
        shadow = self.shadow
        if shadow is None or not self.shadow_on_requests or not shadow.sampled(self.history.branch(key)):
            return
        size = self._size.get(key)
        if size is None:
            size = self._ref_size
        else:
            self._ref_size = size
        if parent is None:
            rec = self.history.get(key)
            parent = rec.parent if rec is not None else None
        shadow.reference(key, size, parent)

    def victims(self, nbytes: int, protected: Protected = never) -> list[Hashable] | None:
        shadow = self.shadow
        if shadow is None or nbytes <= 0:
            return super().victims(nbytes, protected)
        shadow.resize(self._bytes)
        if shadow.leader == 0:
            return super().victims(nbytes, protected)
        size = self._size
        if self.tails_first:  # LRU order among the chains' tails: a chain keeps its head
            chosen = walk_tails_in_order(self._recent, size, self._kids, self._parent, nbytes, protected)
        else:
            chosen = walk_victims([((k, size[k]) for k in self._recent)], nbytes, protected)
        if chosen is not None:
            self._last_victims = set(chosen)
        return chosen

    def _add(self, key: Hashable, size: int, parent: Hashable | None) -> None:
        super()._add(key, size, parent)
        self._bytes += int(size)
        self._recent[key] = None

    def _discard(self, key: Hashable) -> bool:
        size = self._size.get(key)
        if not super()._discard(key):
            return False
        assert size is not None  # the block was resident
        self._bytes -= size
        self._recent.pop(key, None)
        return True

    def on_touch(self, key: Hashable, mass: float) -> None:
        if key not in self._size:
            return
        mass = float(mass)
        if not math.isfinite(mass) or mass < 0:
            raise ValueError(f"attention mass must be a finite number >= 0, got {mass!r}")
        now, old = self.clock(), self._mass.get(key)
        if old is not None and self._settings.number("attn_half_life_s") > 0:
            w = 2.0 ** (-max(now - old[1], 0.0) / self._settings.number("attn_half_life_s"))
            mass = w * old[0] + (1.0 - w) * mass
        self._mass[key] = (mass, now)
        self._rescore(key)

    def on_sharers(self, key: Hashable, sharers: int) -> None:
        if key not in self._size:
            return
        if sharers < 0:
            raise ValueError(f"sharers must be >= 0, got {sharers}")
        if sharers:
            self._sharers[key] = int(sharers)
        else:
            self._sharers.pop(key, None)
        self._rescore(key)

    def on_remove(self, key: Hashable) -> None:
        if self.tau and key in self._last_victims:
            self._victim_left(key)
        super().on_remove(key)

    def _forget(self, key: Hashable) -> None:
        self._scored.pop(key, None)
        self._p.pop(key, None)
        self._mass.pop(key, None)
        self._sharers.pop(key, None)

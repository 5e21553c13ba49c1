"""Trace-driven simulator: replays request traces through the daemon's own policy classes.

Traces use the Mooncake format, one JSON object per line::

    {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}

Each id in ``hash_ids`` names one ``trace_block_tokens``-token block of the prompt (512 in the
Mooncake release); equal ids mean equal prefixes. With ``page_tokens`` smaller than that, each id
is expanded into consecutive child pages (exact, since equal id means equal prefix).

The model, per request in timestamp order:

1. Lookup: the longest prefix of pages present in any tier hits; each hit is served by the tier it
   is in. Pages after the first miss are recomputed even if cached (prefix semantics).
2. Hits in a lower tier are promoted into the first tier (bytes moved ``lower->first``); an
   inclusive tier (the daemon's disk) keeps its copy. Misses are computed and inserted into the
   first tier. Every page of the request is protected (leased) while room is made.
3. Making room: the tier's policy picks victims (all or nothing); a victim with a copy further
   down just leaves, the others are written to the next tier if its admission rule
   (:class:`~tierkv.cache.policy.placement.Placement`) takes them, else dropped.
4. Time to first token: ``max(recompute time of the missed tokens, load time of the hit bytes)``
   (loads overlap layer-wise with compute); recompute cost per token grows with its position.
5. The request finishes: its pages are a chain tail until a later request extends the chain (the
   engine's ``request_finished`` signal, fed to the same reuse models as in the daemon).

Every policy object is built with :func:`tierkv.cache.policy.make_policy`, driven by the trace clock.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tierkv.cache.policy import History, make_policy
from tierkv.cache.policy.placement import Placement
from tierkv.cache.policy.reuse import ReuseModel
from tierkv.sim.stack import TierStack

KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
NEVER = math.inf


class TraceError(ValueError):
    """A trace line is malformed; the message names the line."""


# -- trace -------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace: arrival, prompt and output sizes, and its prompt block ids."""

    timestamp_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]


def _check_int(obj: dict, key: str, where: str, *, required: bool = True) -> int:
    value = obj.get(key)
    if value is None and not required:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or \
            (isinstance(value, float) and not value.is_integer()):
        raise TraceError(f"{where}: {key!r} must be a non-negative integer, got {value!r}")
    return int(value)


def parse_trace(lines: Iterable[str], name: str = "trace") -> list[Request]:
    """Parse Mooncake-format JSON lines (blank lines are skipped).

    Block ids may be integers or strings; they are mapped to dense integers in order of first
    appearance.

    Raises:
        TraceError: naming the first malformed line.
    """
    ids: dict[Any, int] = {}
    out: list[Request] = []
    last_ts = -math.inf
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        ts = obj.get("timestamp")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
            raise TraceError(f"{where}: 'timestamp' must be a non-negative number of ms, got {ts!r}")
        if ts < last_ts:
            raise TraceError(f"{where}: timestamp {ts} is earlier than the previous line's {last_ts}")
        last_ts = ts
        n_in = _check_int(obj, "input_length", where)
        n_out = _check_int(obj, "output_length", where, required=False)
        hashes = obj.get("hash_ids")
        if not isinstance(hashes, list) or not all(
                isinstance(h, (int, str)) and not isinstance(h, bool) for h in hashes):
            raise TraceError(f"{where}: 'hash_ids' must be a list of integers or strings")
        blocks = []
        for h in hashes:
            i = ids.get(h)
            if i is None:
                i = ids[h] = len(ids)
            blocks.append(i)
        out.append(Request(ts / 1000.0, n_in, n_out, tuple(blocks)))
    return out


def load_trace(path: str | Path) -> list[Request]:
    """Read a trace file; see :func:`parse_trace`."""
    path = Path(path)
    with path.open(encoding="utf-8") as fh:
        return parse_trace(fh, path.name)


# -- sizes and rates ---------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": KIB, "mib": MIB, "gib": GIB, "tib": TIB}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int | float) -> int:
    """``"8GiB"``, ``"500MB"``, ``"1e9"`` or a number -> bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return int(text)
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 8GiB, 500MB, 1e9)")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_rate(text: str | int | float) -> float:
    """``"25GB/s"``, ``"3GiB/s"`` or a number -> bytes per second."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    s = str(text).strip()
    if s.lower().endswith("/s"):
        s = s[:-2]
    return float(parse_bytes(s))


def parse_capacity(text: str, unique_bytes: int) -> int:
    """A tier capacity: ``"5%"`` of the trace's unique bytes, or a size (see :func:`parse_bytes`)."""
    s = str(text).strip()
    if s.endswith("%"):
        try:
            pct = float(s[:-1])
        except ValueError:
            raise ValueError(f"not a capacity: {text!r} (examples: 5%, 8GiB)") from None
        if not 0 <= pct <= 100 or not math.isfinite(pct):
            raise ValueError(f"capacity percentage must be within 0-100, got {text!r}")
        return int(unique_bytes * pct / 100.0)
    return parse_bytes(s)


def fmt_bytes(n: float) -> str:
    """Bytes in binary units, 3 significant digits."""
    for unit, div in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n:.0f} B"


# -- configuration -----------------------------------------------------------------------------

@dataclass
class TierSpec:
    """One simulated tier.

    Attributes:
        name: label in reports (``host``, ``disk``, ...); bytes stored into the tier named
            ``disk`` are reported as disk writes.
        capacity: bytes, or a percentage of the unique bytes of the trace (``"5%"``).
        read_bytes_per_s: bandwidth, in raw (decoded) bytes per second, of loading blocks from
            this tier into the compute device (0 = free, e.g. the GPU itself).
        latency_s: fixed cost added once per request that reads from this tier.
        compression: raw bytes / stored bytes (disk and remote tiers store encoded blocks).
        admission: the rule for blocks demoted here: a mode of
            :class:`~tierkv.cache.policy.placement.Placement` (``predicted``, ``reused``, ``all``,
            ``pinned``); ``True`` means ``reused`` (seen twice, shared or pinned), ``False`` ``all``.
        inclusive: a page read from this tier keeps its copy here (the daemon's disk tier does);
            otherwise it moves up and is written again when it is evicted.
        policy: this tier's eviction policy, instead of the one the run names.
    """

    name: str
    capacity: str | int
    read_bytes_per_s: float = 25e9
    latency_s: float = 0.0
    compression: float = 1.0
    admission: bool | str = False
    inclusive: bool = False
    policy: str | None = None

    def __post_init__(self) -> None:
        from tierkv.cache.policy.placement import MODES

        if self.admission_mode not in MODES:
            raise ValueError(f"tier {self.name}: admission must be one of {', '.join(MODES)}, "
                             f"got {self.admission!r}")

    @property
    def admission_mode(self) -> str:
        """The admission rule by name: ``True`` is ``reused``, ``False`` is ``all``."""
        if isinstance(self.admission, bool):
            return "reused" if self.admission else "all"
        return self.admission


@dataclass
class ReplayConfig:
    """Simulator settings (see the module docstring for the model).

    Attributes:
        tiers: fastest first; hits in any tier count.
        page_tokens: tokens per cached page (divides ``trace_block_tokens``).
        trace_block_tokens: tokens per ``hash_ids`` entry in the trace.
        kv_bytes_per_token: KV bytes of one token (Llama-3-8B bf16: 2*32*8*128*2 = 131072).
        prefill_tokens_per_s: recompute speed for the first token of context.
        attn_double_tokens: context length at which a token's prefill cost doubles (0 = flat).
        page_costs: give cost-aware policies the simulator's own miss cost per page (recompute
            time of its tokens at its position, or the fetch time from the next tier if lower) as
            ``cost_fn``, as the daemon passes its transfer engine's cost model.
        policy_settings: per policy name, settings passed to :func:`make_policy`.
        admission_settings: settings of :class:`~tierkv.cache.policy.placement.Placement`.
    """

    tiers: list[TierSpec] = field(default_factory=lambda: [TierSpec("host", "5%")])
    page_tokens: int = 512
    trace_block_tokens: int = 512
    kv_bytes_per_token: int = 131072
    prefill_tokens_per_s: float = 10000.0
    attn_double_tokens: float = 30000.0
    page_costs: bool = True
    policy_settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    admission_settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ValueError("at least one tier is needed")
        if self.page_tokens < 1 or self.trace_block_tokens % self.page_tokens:
            raise ValueError(f"page_tokens ({self.page_tokens}) must divide trace_block_tokens "
                             f"({self.trace_block_tokens})")
        if self.kv_bytes_per_token < 1 or self.prefill_tokens_per_s <= 0:
            raise ValueError("kv_bytes_per_token and prefill_tokens_per_s must be > 0")

    @property
    def page_bytes(self) -> int:
        return self.page_tokens * self.kv_bytes_per_token


# -- expanded trace ----------------------------------------------------------------------------

class Workload:
    """A trace expanded to pages, with each page access's next use (for the OPT oracle).

    Attributes:
        pages: per request, page ids in prefix order (only pages holding at least one token).
        tokens: per request, tokens of each page.
        unique_pages: distinct page ids in the trace.
    """

    def __init__(self, requests: Sequence[Request], page_tokens: int = 512, trace_block_tokens: int = 512):
        if page_tokens < 1 or trace_block_tokens % page_tokens:
            raise ValueError(f"page_tokens ({page_tokens}) must divide trace_block_tokens ({trace_block_tokens})")
        self.requests = list(requests)
        self.page_tokens = page_tokens
        per = trace_block_tokens // page_tokens
        self.pages: list[list[int]] = []
        self.tokens: list[list[int]] = []
        for r in self.requests:
            pages, toks, left = [], [], r.input_tokens
            for b in r.blocks:
                for j in range(per):
                    if left <= 0:
                        break
                    pages.append(b * per + j)
                    toks.append(min(page_tokens, left))
                    left -= page_tokens
            # tokens beyond what hash_ids cover (none in well-formed traces) are never cached
            self.pages.append(pages)
            self.tokens.append(toks)
        self.unique_pages = len({p for ps in self.pages for p in ps})
        self._next: list[list[float]] | None = None

    @property
    def next_use(self) -> list[list[float]]:
        """Per request and page: index of the next request using that page (``inf`` if none)."""
        if self._next is None:
            nxt: dict[int, float] = {}
            out: list[list[float]] = [[]] * len(self.pages)
            for i in range(len(self.pages) - 1, -1, -1):
                row = []
                for p in self.pages[i]:
                    row.append(nxt.get(p, NEVER))
                    nxt[p] = i
                out[i] = row
            self._next = out
        return self._next


# -- results -----------------------------------------------------------------------------------

@dataclass
class ReplayResult:
    """Figures of one (policy, capacity) run. Rates are fractions of all prompt tokens."""

    policy: str
    capacity: str
    capacity_bytes: int
    requests: int
    input_tokens: int
    token_hit_rate: float
    tier_hit_rate: dict[str, float]
    bytes_moved: dict[str, int]
    disk_writes_bytes: int
    dropped_bytes: int
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_recompute_p50_s: float
    ttft_recompute_p99_s: float
    wall_s: float
    placement: str = ""
    admission: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def prefill_seconds(start: int, end: int, rate: float, double_tokens: float) -> float:
    """Seconds to prefill tokens ``[start, end)`` when a token at position x costs
    ``(1 + x / double_tokens) / rate`` (attention grows with the context)."""
    if end <= start:
        return 0.0
    t = (end - start) / rate
    if double_tokens > 0:
        t += (end * end - start * start) / (2.0 * double_tokens * rate)
    return t


# -- the simulator -----------------------------------------------------------------------------

class _Clock:
    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


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
        self.clock = _Clock()
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
        self.host_reuse = ReuseModel(max_records=max(1 << 16, 4 * workload.unique_pages)) \
            if names[0] == "attention" else None
        if "default" in names:
            raise ValueError("policy 'default' needs each tier's policy (TierSpec.policy; the CLI reads "
                             "them from configs/default.toml)")
        self.policies = [self._make_policy(name, i) for i, name in enumerate(names)]
        self.parent_of: dict[int, int] = {}  # page -> previous page of its prefix
        self._hit_tok = 0
        self.rules: list[Placement | None] = [self._make_rule(i) for i in range(len(config.tiers))]
        self._signals: list[Any] = [r for r in self.rules if r is not None]
        if self.host_reuse is not None:
            self._signals.append(self.host_reuse)
        modes = [t.admission_mode for t in config.tiers[1:]]
        self.admission_name = ",".join(modes) if modes else "none"
        self.placement_name = ",".join(f"{t.name}={n}" for t, n in zip(config.tiers, names))

    def _make_rule(self, tier: int) -> Placement | None:
        """The admission rule of tier ``tier`` (None: every victim is written)."""
        spec = self.config.tiers[tier]
        if tier == 0 or spec.admission_mode == "all":
            return None
        # the rule counts every use itself, whatever the policy (the attention policies keep theirs)
        settings = dict(self.config.admission_settings)
        settings.setdefault("ghost_entries", max(16, self.caps[tier] // max(self.sizes[tier], 1)))
        settings.setdefault("max_records", max(1 << 16, 4 * self.w.unique_pages))
        return Placement(spec.admission_mode, **settings)

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

        def fn(key, size):
            c = cost[key]
            if below is not None and below.read_bytes_per_s > 0:
                c = min(c, cfg.page_bytes / below.read_bytes_per_s + below.latency_s)
            return c
        return fn

    def _make_policy(self, name: str, tier: int):
        cfg = self.config
        settings = dict(cfg.policy_settings.get(name, {}))
        kwargs: dict[str, Any] = {}
        if name == "opt":
            kwargs["next_use"] = self._next_of.__getitem__
        elif name == "attention":
            kwargs["history"] = self.history
            if tier == 0 and self.host_reuse is not None:
                kwargs["reuse"] = self.host_reuse.predictor(self.clock)
            if cfg.page_costs:
                kwargs["cost_fn"] = self._page_cost_fn(tier)
            settings.setdefault("block_tokens", cfg.page_tokens)
            settings.setdefault("prefill_tokens_per_s", cfg.prefill_tokens_per_s)
            settings.setdefault("attn_double_tokens", cfg.attn_double_tokens)
            if tier + 1 < len(cfg.tiers):
                below = cfg.tiers[tier + 1]
                settings.setdefault("fetch_bytes_per_s", below.read_bytes_per_s)
                settings.setdefault("fetch_latency_s", below.latency_s)
        return make_policy(name, clock=self.clock, **settings, **kwargs)

    def run(self, capacity_label: str | None = None) -> ReplayResult:
        """Replay the whole workload and return its figures."""
        t0 = time.perf_counter()
        w, cfg, clock = self.w, self.config, self.clock
        tiers = cfg.tiers
        stack = self.stack = TierStack([t.name for t in tiers], self.caps, self.sizes,
                                       [t.inclusive for t in tiers], self.policies, cfg.page_bytes,
                                       self._admit, self.parent_of, self._left)
        hit_tokens = [0] * len(tiers)
        total_tokens = 0
        ttft: list[float] = []
        ttft_ref: list[float] = []
        next_use = w.next_use if self.policy_name == "opt" else None
        rate, dbl = cfg.prefill_tokens_per_s, cfg.attn_double_tokens
        for i, req in enumerate(w.requests):
            clock.now = req.timestamp_s
            pages, toks = w.pages[i], w.tokens[i]
            if next_use is not None:
                for p, nu in zip(pages, next_use[i]):
                    self._next_of[p] = nu
            total_tokens += req.input_tokens
            load_b = self._serve(pages, toks, hit_tokens)
            compute = prefill_seconds(self._hit_tok, req.input_tokens, rate, dbl)
            ttft.append(max(compute, self._load_seconds(load_b)))
            ttft_ref.append(prefill_seconds(0, req.input_tokens, rate, dbl))
            for rule in self._signals:
                rule.request_finished(pages, clock.now)
        total = max(total_tokens, 1)
        label = capacity_label if capacity_label is not None else str(tiers[0].capacity)
        return ReplayResult(
            policy=self.policy_name, capacity=label, capacity_bytes=self.caps[0], requests=len(w.requests),
            input_tokens=total_tokens, token_hit_rate=sum(hit_tokens) / total,
            tier_hit_rate={tiers[t].name: hit_tokens[t] / total for t in range(len(tiers))},
            bytes_moved=stack.c.moved, disk_writes_bytes=stack.c.disk_writes, dropped_bytes=stack.c.dropped_bytes,
            ttft_mean_s=sum(ttft) / max(len(ttft), 1), ttft_p50_s=_pct(ttft, 0.5), ttft_p99_s=_pct(ttft, 0.99),
            ttft_recompute_p50_s=_pct(ttft_ref, 0.5), ttft_recompute_p99_s=_pct(ttft_ref, 0.99),
            wall_s=time.perf_counter() - t0, placement=self.placement_name, admission=self.admission_name)

    def _serve(self, pages: list[int], toks: list[int], hit_tokens: list[int]) -> list[int]:
        """One request: count its prefix hits, promote cached pages and insert the rest into tier 0.
        Returns the bytes read per tier."""
        stack, now = self.stack, self.clock.now
        held = stack.held
        load_b = [0] * stack.n
        k, n = 0, len(pages)
        while k < n and pages[k] in held:
            t = stack.fastest(pages[k])
            hit_tokens[t] += toks[k]  # type: ignore[index]
            load_b[t] += stack.page_bytes  # type: ignore[index]
            k += 1
        self._hit_tok = sum(toks[:k])
        for rule in self._signals:
            rule.requested(pages, now)
        for j in range(1, n):
            self.parent_of[pages[j]] = pages[j - 1]
        incoming: list[int] = []
        pol0 = self.policies[0]
        for p in pages:
            t = stack.fastest(p)
            if t == 0:
                pol0.on_access(p)
                continue
            if t is not None:
                stack.promote(p, t)
            incoming.append(p)
        stack.insert0(incoming, set(pages))
        return load_b

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

    def _admit(self, page: int, tier: int) -> bool:
        """Whether a victim of tier ``tier - 1`` is written into ``tier``."""
        rule = self.rules[tier]
        return rule is None or rule.admit(page, self.clock.now)


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


# -- request profile (--advise) ----------------------------------------------------------------

class _Fenwick:
    __slots__ = ("n", "t")

    def __init__(self, n: int) -> None:
        self.n, self.t = n, [0] * (n + 1)

    def add(self, i: int, v: int) -> None:
        i += 1
        while i <= self.n:
            self.t[i] += v
            i += i & -i

    def prefix(self, i: int) -> int:  # sum of [0, i)
        s = 0
        while i > 0:
            s += self.t[i]
            i -= i & -i
        return s


def profile(workload: Workload, config: ReplayConfig, decode_s_per_token: float = 0.02) -> dict[str, Any]:
    """The request profile to measure before sizing tiers (prefix reuse, reuse distances,
    working set, concurrency) and recommended tier sizes. Sizes are in bytes.

    Reuse distances are LRU stack distances over pages (distinct bytes touched between two uses of
    a page), so the LRU hit-rate curve and the recommended sizes follow from them directly.
    """
    w, pb = workload, config.page_bytes
    reqs = w.requests
    n_req = len(reqs)
    if not n_req:
        raise ValueError("the trace has no requests")
    t_first, t_last = reqs[0].timestamp_s, reqs[-1].timestamp_s
    duration = max(t_last - t_first, 1e-9)
    total_tokens = sum(r.input_tokens for r in reqs)
    # prefix reuse with an unbounded cache
    seen: set[int] = set()
    inf_hit = 0
    reqs_hit = 0
    for pages, toks in zip(w.pages, w.tokens):
        k = 0
        while k < len(pages) and pages[k] in seen:
            k += 1
        inf_hit += sum(toks[:k])
        reqs_hit += k > 0
        seen.update(pages)
    # reuse distances: time and LRU stack distance (distinct pages in between)
    n_acc = sum(len(p) for p in w.pages)
    bit = _Fenwick(n_acc)
    last_pos: dict[int, int] = {}
    last_t: dict[int, float] = {}
    stack: list[int] = []
    stack_tokens: list[tuple[int, int]] = []  # (distance, tokens) for the hit curve
    gaps: list[float] = []
    pos = 0
    for r, pages, toks in zip(reqs, w.pages, w.tokens):
        for p, tk in zip(pages, toks):
            j = last_pos.get(p)
            if j is not None:
                d = bit.prefix(pos) - bit.prefix(j + 1)
                stack.append(d)
                stack_tokens.append((d, tk))
                gaps.append(r.timestamp_s - last_t[p])
                bit.add(j, -1)
            bit.add(pos, 1)
            last_pos[p] = pos
            last_t[p] = r.timestamp_s
            pos += 1
    # working set: distinct bytes touched per window
    def window_bytes(width: float) -> list[int]:
        out, start, cur = [], 0, set()
        for i, r in enumerate(reqs):
            if r.timestamp_s >= reqs[start].timestamp_s + width:
                out.append(len(cur) * pb)
                start, cur = i, set()
            cur.update(w.pages[i])
        out.append(len(cur) * pb)
        return out
    # concurrency: each request lasts its full prefill plus its decode
    rate, dbl = config.prefill_tokens_per_s, config.attn_double_tokens
    events: list[tuple[float, int, int]] = []
    for r in reqs:
        end = r.timestamp_s + prefill_seconds(0, r.input_tokens, rate, dbl) + r.output_tokens * decode_s_per_token
        kv = (r.input_tokens + r.output_tokens) * config.kv_bytes_per_token
        events.append((r.timestamp_s, 1, kv))
        events.append((end, -1, -kv))
    events.sort(key=lambda e: (e[0], e[1]))
    live = live_bytes = peak = peak_bytes = 0
    area = 0.0
    prev_t = t_first
    for t, d, kv in events:
        area += live * (t - prev_t)
        prev_t = t
        live += d
        live_bytes += kv
        peak, peak_bytes = max(peak, live), max(peak_bytes, live_bytes)
    span = max(prev_t - t_first, 1e-9)
    # LRU hit-rate curve from stack distances (page level; an upper bound for prefix hits)
    stack_tokens.sort()
    curve: list[tuple[int, float]] = []
    acc = 0
    for d, tk in stack_tokens:
        acc += tk
        curve.append((d + 1, acc / max(total_tokens, 1)))

    def size_for(frac: float) -> int:
        goal = frac * (curve[-1][1] if curve else 0.0)
        for pages_needed, hit in curve:
            if hit >= goal:
                return pages_needed * pb
        return w.unique_pages * pb

    ws60, ws600 = window_bytes(60.0), window_bytes(600.0)
    unique_bytes = w.unique_pages * pb
    return {
        "requests": n_req,
        "duration_s": duration,
        "arrival_rate_per_s": n_req / duration,
        "input_tokens": {"mean": total_tokens / n_req, "p50": _pct([r.input_tokens for r in reqs], 0.5),
                         "p99": _pct([r.input_tokens for r in reqs], 0.99)},
        "output_tokens_mean": sum(r.output_tokens for r in reqs) / n_req,
        "page_tokens": w.page_tokens,
        "page_bytes": pb,
        "unique_pages": w.unique_pages,
        "unique_bytes": unique_bytes,
        "prefix_reuse": {"token_hit_rate_unbounded": inf_hit / max(total_tokens, 1),
                         "requests_with_prefix_hit": reqs_hit / n_req},
        "reuse_distance": {
            "reuses": len(gaps),
            "time_s": {q: _pct(gaps, v) for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
            "bytes": {q: _pct(stack, v) * pb for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
        },
        "working_set_bytes": {"per_60s_mean": sum(ws60) / len(ws60), "per_60s_max": max(ws60),
                              "per_600s_max": max(ws600)},
        "concurrency": {"mean": area / span, "peak": peak, "peak_live_kv_bytes": peak_bytes,
                        "decode_s_per_token": decode_s_per_token},
        "recommended": {
            "gpu_bytes": peak_bytes,
            "host_bytes": size_for(0.8),
            "disk_bytes": size_for(0.99),
            "why": "gpu: peak KV of in-flight sequences; host: LRU reaches 80% of the unbounded "
                   "prefix hit rate; disk: 99% of it",
        },
    }

"""Simulator settings: the tiers of the replayed stack and the cost model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tierkv.cache.admission import MODES


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
            :class:`~tierkv.cache.admission.Admission` (``predicted``, ``reused``, ``all``,
            ``pinned``); ``True`` means ``reused`` (used again since it was cached, or pinned), ``False``
            ``all``.
        inclusive: a page read from this tier keeps its copy here (the daemon's disk tier does);
            otherwise it moves up and is written again when it is evicted.
        policy: this tier's eviction policy, instead of the one the run names.
        write_bytes_per_s: bandwidth of writing blocks into this tier, in stored bytes per second;
            while its writer has nothing queued every victim is written (the admission rule is told
            the writer has spare bandwidth). 0: not modelled, the rule decides every victim.
        policy_settings: this tier's own policy settings, over the run's (those its policy has).
    """

    name: str
    capacity: str | int
    read_bytes_per_s: float = 25e9
    latency_s: float = 0.0
    compression: float = 1.0
    admission: bool | str = False
    inclusive: bool = False
    policy: str | None = None
    write_bytes_per_s: float = 0.0
    policy_settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.write_bytes_per_s >= 0:
            raise ValueError(f"tier {self.name}: write_bytes_per_s must be >= 0, got {self.write_bytes_per_s!r}")
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
            ``cost_fn``, as the daemon passes its store's cost model.
        policy_settings: per policy name, settings passed to :func:`make_policy`.
        admission_settings: settings of :class:`~tierkv.cache.admission.Admission`.
        store_gate: which of a request's missed pages are stored, as the daemon's ``store.gate``:
            ``all`` (every one, as a plain client stores) or ``predicted`` (the store gate an engine's
            connector asks: :mod:`tierkv.cache.store_gate`).
        store_cost_bytes_per_s: what storing a page costs (``store.cost_bytes_per_s``).
        store_gate_settings: settings of :class:`~tierkv.cache.store_gate.StoreGate`.
        quotas: per tenant (a trace line's ``tenant``), its quota in bytes per tier name (``host``,
            ``disk``), decided as the daemon's tier managers decide (:mod:`tierkv.cache.quotas`).
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
    store_gate: str = "all"
    store_cost_bytes_per_s: float = float(1 << 30)
    store_gate_settings: dict[str, Any] = field(default_factory=dict)
    quotas: dict[str, dict[str, int]] = field(default_factory=dict)

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


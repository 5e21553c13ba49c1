"""``tierkv replay --advise``: the admission setting to run a trace with, measured by replaying it.

The daemon's default placement (as the config sets it) is replayed at the recommended host and disk
sizes once per admission mode; the advice is the mode with the highest token hit rate, preferring
fewer disk bytes written when hit rates are within ``tie_points`` of each other. OPT writing every
victim is replayed beside them as the ceiling.

The host order is advised the same way: with the chosen mode, the default placement is replayed at
each ``host.shadow_rate`` of ``shadow_rates`` (0: the learned score alone; 1: the shadow simulates
every key), and the advice says how many points and what share of the disk writes it measured
against the default configuration (the configured mode and shadow rate) on this trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from tierkv.core.units import fmt_bytes
from tierkv.sim.result import ReplayResult
from tierkv.sim.simulator import replay
from tierkv.sim.spec import ReplayConfig, TierSpec
from tierkv.sim.workload import Workload


def advise_admission(workload: Workload, config: ReplayConfig, host_bytes: int, disk_bytes: int,
                     configure: Callable[[str, ReplayConfig], ReplayConfig],
                     modes: Sequence[str] = ("predicted", "reused", "all"),
                     tie_points: float = 0.5, shadow_rates: Sequence[float] = (0.0, 1.0)) -> dict[str, Any]:
    """Replay the default placement under each admission mode and pick one.

    Args:
        workload: the expanded trace.
        config: the replay settings; its first two tiers are resized to the recommendation (a disk
            tier is added when there is none).
        host_bytes: recommended host capacity.
        disk_bytes: recommended disk capacity (raw bytes; stored bytes are smaller by the disk's
            compression).
        configure: ``configure(name, config)`` -> the config policy ``name`` runs with (the CLI's
            per-policy setup, which makes ``default`` the daemon's placement).
        modes: admission modes to compare.
        tie_points: hit-rate difference (percentage points) under which fewer writes win.
        shadow_rates: ``host.shadow_rate`` values replayed beside the configured one.

    Returns:
        ``{"admission": mode, "why": text, "runs": {mode: figures}, "opt": figures, "shadow_rate":
        the advised rate, "shadow_runs": {rate: figures}, "default": figures of the configuration as
        it is, "gain_points": advised minus default hit rate, "writes_ratio": advised / default disk
        bytes}``.
    """
    base = _resized(config, host_bytes, disk_bytes)

    def run(name: str, mode: str | None, shadow: float | None = None) -> ReplayResult:
        cfg = configure(name, base)
        if name != "opt" and mode is not None:
            for t in cfg.tiers[1:]:
                t.admission = mode
        if shadow is not None:
            cfg.tiers[0].policy_settings = {**cfg.tiers[0].policy_settings, "shadow_rate": shadow}
        return replay(workload, name, cfg)

    configured = configure("default", base)
    default_mode = configured.tiers[1].admission_mode
    default_rate = float(configured.tiers[0].policy_settings.get("shadow_rate", 0.0))
    runs = {mode: run("default", mode) for mode in modes}
    best = max(runs.values(), key=lambda r: r.token_hit_rate)
    close = [m for m, r in runs.items() if (best.token_hit_rate - r.token_hit_rate) * 100 <= tie_points]
    pick = min(close, key=lambda m: runs[m].disk_writes_bytes)
    opt = run("opt", "all")
    figures = {m: _figures(r) for m, r in runs.items()}
    why = (f"highest token hit rate at host {fmt_bytes(host_bytes)} / disk {fmt_bytes(disk_bytes)}"
           + (f" (within {tie_points} points, fewest disk writes)" if len(close) > 1 else ""))
    shadow_runs = {default_rate: runs[pick]}
    for rate in shadow_rates:
        if rate not in shadow_runs:
            shadow_runs[rate] = run("default", pick, rate)
    best_rate = max(shadow_runs, key=lambda k: (round(shadow_runs[k].token_hit_rate, 6), k == default_rate, -k))
    default = runs[default_mode] if default_mode in runs else run("default", None)
    advised = shadow_runs[best_rate]
    return {"admission": pick, "why": why, "runs": figures, "opt": _figures(opt), "shadow_rate": best_rate,
            "shadow_runs": {str(k): _figures(v) for k, v in shadow_runs.items()}, "default": _figures(default),
            "gain_points": (advised.token_hit_rate - default.token_hit_rate) * 100,
            "writes_ratio": advised.disk_writes_bytes / default.disk_writes_bytes if default.disk_writes_bytes
            else None}


def _resized(config: ReplayConfig, host_bytes: int, disk_bytes: int) -> ReplayConfig:
    """``config`` with its host and disk tiers at the recommended sizes (a disk tier added when there
    is none; its capacity in stored bytes, smaller than ``disk_bytes`` by its compression)."""
    host = TierSpec(**{**asdict(config.tiers[0]), "capacity": max(1, host_bytes)})
    if len(config.tiers) > 1:
        disk = config.tiers[1]
        disk = TierSpec(**{**asdict(disk), "capacity": max(1, int(disk_bytes / max(disk.compression, 1.0)))})
    else:
        disk = TierSpec("disk", max(1, int(disk_bytes / 1.4)), read_bytes_per_s=5e9, latency_s=1e-4,
                        compression=1.4, inclusive=True, write_bytes_per_s=2e9)
    fields = {f: getattr(config, f) for f in config.__dataclass_fields__}
    return ReplayConfig(**{**fields, "tiers": [host, disk]})


def _figures(r: ReplayResult) -> dict[str, Any]:
    return {"token_hit_rate": r.token_hit_rate, "disk_writes_bytes": r.disk_writes_bytes,
            "ttft_p50_s": r.ttft_p50_s, "placement": r.placement, "admission": r.admission}

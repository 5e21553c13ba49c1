"""``tierkv stats --plot FILE.png``: tier fill, hit rate and link bandwidth over the daemon's sample ring."""

from __future__ import annotations

from typing import Any

TIER_COLORS = {"gpu": "#7b3294", "host": "#1f77b4", "disk": "#ff7f0e", "remote": "#2ca02c"}


def series(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-interval series from cumulative samples: seconds before the newest sample, fill per tier (%),
    hit rate per tier and of fetches over all tiers ("any tier"; %, None in intervals without lookups)
    and MB/s per link."""
    if len(samples) < 2:
        raise ValueError("the daemon has fewer than 2 samples yet (one is taken every server.sample_interval_s)")
    t_end = samples[-1]["t"]
    ts: list[float] = []
    fill: dict[str, list[float]] = {}
    hits: dict[str, list[float | None]] = {}
    links: dict[str, list[float]] = {}
    for a, b in zip(samples, samples[1:]):
        dt = b["t"] - a["t"]
        if dt <= 0:
            continue
        ts.append(b["t"] - t_end)
        for name, d in b["tiers"].items():
            fill.setdefault(name, []).append(100.0 * d["used"] / d["capacity"] if d["capacity"] else 0.0)
            p = a["tiers"].get(name, d)
            h, m = d["hits"] - p["hits"], d["misses"] - p["misses"]
            hits.setdefault(name, []).append(100.0 * h / (h + m) if h + m > 0 else None)
        if "served" in b:
            sa, sb = a.get("served", b["served"]), b["served"]
            h, m = sb["hits"] - sa["hits"], sb["misses"] - sa["misses"]
            hits.setdefault("any tier", []).append(100.0 * h / (h + m) if h + m > 0 else None)
        for link, n in b["links"].items():
            links.setdefault(link, []).append(max(0, n - a["links"].get(link, n)) / dt / 1e6)
    return {"t": ts, "fill": fill, "hit_rate": hits, "links": links}


def render(snapshot: dict[str, Any], path: str, title: str = "tierkv") -> None:
    """Write a PNG with three stacked panels sharing the time axis.

    Raises:
        ValueError: too few samples, or matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install 'tierkv[plot]')") from None
    s = series(snapshot["samples"])
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True, constrained_layout=True)
    fill_ax, hit_ax, link_ax = axes
    for name, ys in s["fill"].items():
        fill_ax.plot(s["t"], ys, label=name, color=TIER_COLORS.get(name), lw=1.8)
    fill_ax.set_ylabel("fill (% of capacity)")
    fill_ax.set_ylim(0, 105)
    for name, ys in s["hit_rate"].items():
        if any(y is not None for y in ys):
            style = {"color": "black", "ls": "--", "lw": 1.4} if name == "any tier" else \
                {"color": TIER_COLORS.get(name), "lw": 1.8}
            hit_ax.plot(s["t"], [float("nan") if y is None else y for y in ys], label=name,
                        marker="." if len(ys) < 60 else None, **style)
    hit_ax.set_ylabel("hit rate (%)")
    hit_ax.set_ylim(0, 105)
    active = {k: v for k, v in s["links"].items() if any(v)}
    for link, ys in sorted(active.items()):
        link_ax.plot(s["t"], ys, label=link, lw=1.5)
    link_ax.set_ylabel("link bandwidth (MB/s)")
    link_ax.set_ylim(bottom=0)
    if not active:
        link_ax.text(0.5, 0.5, "no bytes moved between tiers", transform=link_ax.transAxes, ha="center",
                     color="grey")
    link_ax.set_xlabel(f"seconds before the last sample (one every {snapshot['interval_s']:g} s)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=9, frameon=False)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)

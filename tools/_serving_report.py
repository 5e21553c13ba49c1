"""The serving benchmark's tables: one per workload and pressure, figures then ratios."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

COLUMNS = (  # (heading, width, key of figures())
    ("config", 8, "config"), ("TTFT p50", 9, "ttft_p50_ms"), ("p99", 8, "ttft_p99_ms"),
    ("TPOT p50", 9, "tpot_p50_ms"), ("p99", 8, "tpot_p99_ms"), ("ITL p99", 8, "itl_p99_ms"),
    ("req/s", 7, "requests_per_s"), ("out tok/s", 9, "output_tokens_per_s"),
    ("cached %", 8, "cached_pct"), ("device", 8, "device_hit_tokens"), ("connector", 9, "connector_hit_tokens"),
    ("store ms/step", 13, "store_ms_per_step"), ("copy", 6, "copy_ms_per_step"), ("stored %", 8, "stored_pct"), ("idle %", 6, "idle_pct"),
    ("load ms/step", 12, "load_ms_per_step"), ("failed", 6, "failed"), ("greedy diff", 11, "greedy_diff"),
)
RATIOS = (("TTFT p50", "ttft_p50_ms"), ("TTFT p99", "ttft_p99_ms"), ("TPOT p50", "tpot_p50_ms"),
          ("TPOT p99", "tpot_p99_ms"), ("ITL p99", "itl_p99_ms"), ("req/s", "requests_per_s"),
          ("out tok/s", "output_tokens_per_s"))


def load_report(path: str) -> dict:
    """A saved run (``--out`` of an earlier invocation); a missing or unreadable file exits with one line."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--report {path}: cannot read a saved run ({e})") from None
    if not isinstance(report, dict) or not isinstance(report.get("runs"), list):
        raise SystemExit(f"--report {path}: not a saved run of this benchmark (no 'runs' list)")
    return report


def figures(run: dict, reference: list[str] | None) -> dict:
    """A run's figures: latencies in ms from vLLM's client, cached prompt tokens from vLLM's counters."""
    c = run["client"]
    n = run["client"]["counters"]
    prompt = c.get("total_input_tokens") or 0
    device, connector = n["vllm:prefix_cache_hits"], n["vllm:external_prefix_cache_hits"]
    greedy = run.get("greedy") or []
    steps = n.get("vllm:tierkv_store_steps", 0.0)
    per_step = 1e3 * n.get("vllm:tierkv_store_seconds", 0.0) / steps if steps else None
    copy_step = 1e3 * n.get("vllm:tierkv_store_copy_seconds", 0.0) / steps if steps else None
    offered = n.get("vllm:tierkv_store_offered", 0.0)
    stored_pct = 100.0 * (offered - n.get("vllm:tierkv_store_gated", 0.0)) / offered if offered else None
    idle_pct = 100.0 * n.get("vllm:tierkv_store_idle", 0.0) / offered if offered else None  # of the gated, stored idle
    loads = n.get("vllm:tierkv_load_steps", 0.0)
    load_step = 1e3 * n.get("vllm:tierkv_load_seconds", 0.0) / loads if loads else None
    diff = sum(a != b for a, b in zip(greedy, reference or greedy, strict=False))
    return {"config": run["config"], "ttft_p50_ms": c["p50_ttft_ms"], "ttft_p99_ms": c["p99_ttft_ms"],
            "tpot_p50_ms": c["p50_tpot_ms"], "tpot_p99_ms": c["p99_tpot_ms"], "itl_p99_ms": c["p99_itl_ms"],
            "requests_per_s": c["request_throughput"], "output_tokens_per_s": c["output_throughput"],
            "prompt_tokens": prompt, "device_hit_tokens": int(device), "connector_hit_tokens": int(connector),
            "tierkv_hit_tokens": int(n["vllm:tierkv_hit_tokens"]),
            "cached_pct": 100.0 * (device + connector) / prompt if prompt else 0.0,
            "store_ms_per_step": "-" if per_step is None else round(per_step, 2),
            "copy_ms_per_step": "-" if copy_step is None else round(copy_step, 2),
            "stored_pct": "-" if stored_pct is None else round(stored_pct, 1),
            "idle_pct": "-" if idle_pct is None else round(idle_pct, 1),
            "store_offered_blocks": int(offered), "store_gated_blocks": int(n.get("vllm:tierkv_store_gated", 0.0)),
            "load_ms_per_step": "-" if load_step is None else round(load_step, 2), "load_steps": int(loads),
            "load_gb": round(n.get("vllm:tierkv_load_bytes", 0.0) / 1e9, 2),
            "async_loads": int(n.get("vllm:tierkv_async_loads", 0)),
            "completed": c.get("completed", 0), "failed": c.get("failed", 0),
            "greedy_diff": f"{diff}/{len(greedy)}"}


def _cell(v: object, width: int) -> str:
    if isinstance(v, float):
        return f"{v:{width}.{2 if abs(v) < 10 else 1 if abs(v) < 1000 else 0}f}"
    return f"{v!s:>{width}}"


def print_tables(report: dict) -> None:
    """Print one table per workload and pressure, and store each run's figures under ``"figures"``."""
    runs = report["runs"]
    for name, wl in report["workloads"].items():
        pressures = dict.fromkeys(r["pressure"] for r in runs if r["workload"] == name and r["config"] != "vllm")
        base = next((r for r in runs if r["workload"] == name and r["config"] == "vllm"), None)
        for pressure in pressures or [base["pressure"] if base else "full"]:
            rows = [r for r in runs if r["workload"] == name and (r["pressure"] == pressure or r is base)]
            ref_run = base if base and "greedy" in base else next((r for r in rows if "greedy" in r), None)
            reference = ref_run["greedy"] if ref_run else None
            print(f"\n{name}, host tier {pressure} ({PRESSURE_WORDS.get(pressure, pressure)}): "
                  f"{wl['requests']} requests, working set {wl['working_set_bytes'] / 1e9:.2f} GB; "
                  "latencies in ms; cached: prompt tokens vLLM served from its cache (device) or the connector")
            print("  ".join(f"{h:>{w}}" for h, w, _ in COLUMNS))
            figs: dict[str, dict] = {}
            for r in rows:
                if "error" in r:
                    print(f"{r['config']:>8}  failed: {r['error'].splitlines()[0]}")
                    continue
                f = r["figures"] = figures(r, reference)
                figs[r["config"]] = f
                print("  ".join(_cell(f[k], w) for _h, w, k in COLUMNS))
            _print_ratios(figs)
            _print_reusable(rows, wl)
            _print_tail_gaps(rows, wl)


def _print_ratios(figs: dict[str, dict]) -> None:
    for ref in ("vllm", "lmcache"):
        if ref not in figs or len(figs) < 2:
            continue
        for cfg, f in figs.items():
            if cfg != ref:
                print(f"  {cfg} / {ref}: " + "  ".join(f"{h} {_ratio(f[k], figs[ref][k])}" for h, k in RATIOS))


def _print_reusable(rows: list[dict], wl: dict) -> None:
    """TTFT p50 of the requests a KV cache outside vLLM can speed up (``wl["reusable"]``) and of the others,
    per configuration (runs whose client saved per-request TTFTs)."""
    picked = set(wl.get("reusable") or ())
    if not picked:
        return
    cells = []
    for r in rows:
        ttfts = r.get("client", {}).get("ttfts") or []
        if "error" in r or len(ttfts) != wl["requests"]:
            continue
        some = [t for i, t in enumerate(ttfts) if i in picked]
        rest = [t for i, t in enumerate(ttfts) if i not in picked]
        cells.append(f"{r['config']} {1e3 * statistics.median(some):.0f}"
                     + (f" / {1e3 * statistics.median(rest):.0f}" if rest else ""))
    if cells:
        print(f"  TTFT p50 (ms) of the {len(picked)} requests a cache beside vLLM's own can speed up / of the "
              f"other {wl['requests'] - len(picked)}: " + ", ".join(cells))


def tail_gaps(client: dict, reusable: set[int], share: float = 0.01, step_s: float = 0.02) -> dict:
    """The longest ``share`` of the inter-token gaps and the steps that ended them: a gap whose end comes
    within ``step_s`` of another request's first token ended on a step that prefilled that request.
    Returns the gaps' count and mean (ms), how many ended on a prefill step, and how many of those
    prefilled a request of ``reusable`` (one a cache beside vLLM's own can speed up)."""
    starts, ttfts, itls = client["start_times"], client["ttfts"], client["itls"]
    firsts = sorted((s + t, i) for i, (s, t) in enumerate(zip(starts, ttfts, strict=True)))
    gaps = []
    for i, (s, t, its) in enumerate(zip(starts, ttfts, itls, strict=True)):
        end = s + t
        for g in its:
            end += g
            gaps.append((g, end, i))
    gaps.sort(reverse=True)
    top = gaps[:max(1, round(share * len(gaps)))]
    on_prefill = on_reusable = 0
    for _g, end, i in top:
        near = [j for f, j in firsts if j != i and abs(f - end) <= step_s]
        on_prefill += bool(near)
        on_reusable += any(j in reusable for j in near)
    return {"gaps": len(top), "mean_ms": 1e3 * statistics.fmean(g for g, _e, _i in top),
            "on_prefill": on_prefill, "on_reusable": on_reusable}


def _print_tail_gaps(rows: list[dict], wl: dict) -> None:
    """Per configuration: the longest 1% of the inter-token gaps (ITL p99's tail) and the steps they ended on."""
    picked = set(wl.get("reusable") or ())
    cells = []
    for r in rows:
        c = r.get("client", {})
        if "error" in r or not c.get("itls") or len(c.get("ttfts") or []) != wl["requests"]:
            continue
        t = r["tail_gaps"] = tail_gaps(c, picked)
        cells.append(f"{r['config']} {t['gaps']} gaps of {t['mean_ms']:.0f} ms on average, {t['on_prefill']} on "
                     f"another request's first step ({t['on_reusable']} of one a cache can speed up)")
    if cells:
        print("  longest 1% of the gaps between tokens: " + "; ".join(cells))


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


PRESSURE_WORDS = {"full": "holds the working set", "quarter": "holds a quarter of it, the rest on disk"}

"""The request profile of a trace (``tierkv replay --advise``): prefix reuse, reuse distances,
working set, concurrency, and the tier sizes they recommend.

Reuse distances are LRU stack distances over pages (distinct bytes touched between two uses of a
page), so the LRU hit-rate curve and the recommended sizes follow from them directly.
"""

from __future__ import annotations

from typing import Any

from tierkv.sim.result import percentile
from tierkv.sim.spec import ReplayConfig
from tierkv.sim.workload import Workload, prefill_seconds

_QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))


class _Fenwick:
    """Prefix sums with point updates in O(log n), for counting distinct pages between two uses."""

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


def _unbounded_hits(w: Workload) -> tuple[int, int]:
    """Prefix-hit tokens and requests with a prefix hit, with an unbounded cache."""
    seen: set[int] = set()
    hit_tokens = hit_requests = 0
    for pages, toks in zip(w.pages, w.tokens):
        k = 0
        while k < len(pages) and pages[k] in seen:
            k += 1
        hit_tokens += sum(toks[:k])
        hit_requests += k > 0
        seen.update(pages)
    return hit_tokens, hit_requests


def _reuse_distances(w: Workload) -> tuple[list[int], list[tuple[int, int]], list[float]]:
    """Per reuse: LRU stack distance in pages, (distance, tokens), and the time since the last use."""
    bit = _Fenwick(sum(len(p) for p in w.pages))
    last_pos: dict[int, int] = {}
    last_t: dict[int, float] = {}
    stack: list[int] = []
    stack_tokens: list[tuple[int, int]] = []
    gaps: list[float] = []
    pos = 0
    for r, pages, toks in zip(w.requests, w.pages, w.tokens):
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
    return stack, stack_tokens, gaps


def _window_bytes(w: Workload, width: float, page_bytes: int) -> list[int]:
    """Distinct bytes touched in consecutive windows of ``width`` seconds."""
    reqs = w.requests
    out: list[int] = []
    cur: set[int] = set()
    start = 0
    for i, r in enumerate(reqs):
        if r.timestamp_s >= reqs[start].timestamp_s + width:
            out.append(len(cur) * page_bytes)
            start, cur = i, set()
        cur.update(w.pages[i])
    out.append(len(cur) * page_bytes)
    return out


def _concurrency(w: Workload, config: ReplayConfig, decode_s_per_token: float) -> dict[str, Any]:
    """Sequences in flight: each request lasts its full prefill plus its decode."""
    rate, dbl = config.prefill_tokens_per_s, config.attn_double_tokens
    events: list[tuple[float, int, int]] = []
    for r in w.requests:
        end = r.timestamp_s + prefill_seconds(0, r.input_tokens, rate, dbl) + r.output_tokens * decode_s_per_token
        kv = (r.input_tokens + r.output_tokens) * config.kv_bytes_per_token
        events.append((r.timestamp_s, 1, kv))
        events.append((end, -1, -kv))
    events.sort(key=lambda e: (e[0], e[1]))
    live = live_bytes = peak = peak_bytes = 0
    area = 0.0
    t_first = prev_t = w.requests[0].timestamp_s
    for t, d, kv in events:
        area += live * (t - prev_t)
        prev_t = t
        live += d
        live_bytes += kv
        peak, peak_bytes = max(peak, live), max(peak_bytes, live_bytes)
    span = max(prev_t - t_first, 1e-9)
    return {"mean": area / span, "peak": peak, "peak_live_kv_bytes": peak_bytes,
            "decode_s_per_token": decode_s_per_token}


def _size_for(stack_tokens: list[tuple[int, int]], total_tokens: int, unique_pages: int,
              page_bytes: int) -> Any:
    """``size(frac)``: the LRU capacity reaching ``frac`` of the best page-level hit rate."""
    curve: list[tuple[int, float]] = []
    acc = 0
    for d, tk in sorted(stack_tokens):
        acc += tk
        curve.append((d + 1, acc / max(total_tokens, 1)))

    def size(frac: float) -> int:
        goal = frac * (curve[-1][1] if curve else 0.0)
        for pages_needed, hit in curve:
            if hit >= goal:
                return pages_needed * page_bytes
        return unique_pages * page_bytes
    return size


def profile(workload: Workload, config: ReplayConfig, decode_s_per_token: float = 0.02) -> dict[str, Any]:
    """The request profile to measure before sizing tiers, and recommended tier sizes.

    Args:
        workload: the expanded trace.
        config: page size and cost model.
        decode_s_per_token: decode time per output token, for the concurrency estimate.

    Returns:
        Figures by topic (sizes in bytes), ending with ``recommended`` gpu, host and disk sizes.

    Raises:
        ValueError: the trace has no requests.
    """
    w, pb = workload, config.page_bytes
    reqs = w.requests
    n_req = len(reqs)
    if not n_req:
        raise ValueError("the trace has no requests")
    duration = max(reqs[-1].timestamp_s - reqs[0].timestamp_s, 1e-9)
    total_tokens = sum(r.input_tokens for r in reqs)
    inf_hit, reqs_hit = _unbounded_hits(w)
    stack, stack_tokens, gaps = _reuse_distances(w)
    concurrency = _concurrency(w, config, decode_s_per_token)
    size_for = _size_for(stack_tokens, total_tokens, w.unique_pages, pb)
    ws60, ws600 = _window_bytes(w, 60.0, pb), _window_bytes(w, 600.0, pb)
    inputs = [r.input_tokens for r in reqs]
    return {
        "requests": n_req,
        "duration_s": duration,
        "arrival_rate_per_s": n_req / duration,
        "input_tokens": {"mean": total_tokens / n_req, "p50": percentile(inputs, 0.5),
                         "p99": percentile(inputs, 0.99)},
        "output_tokens_mean": sum(r.output_tokens for r in reqs) / n_req,
        "page_tokens": w.page_tokens,
        "page_bytes": pb,
        "unique_pages": w.unique_pages,
        "unique_bytes": w.unique_pages * pb,
        "prefix_reuse": {"token_hit_rate_unbounded": inf_hit / max(total_tokens, 1),
                         "requests_with_prefix_hit": reqs_hit / n_req},
        "reuse_distance": {
            "reuses": len(gaps),
            "time_s": {q: percentile(gaps, v) for q, v in _QUANTILES},
            "bytes": {q: percentile(stack, v) * pb for q, v in _QUANTILES},
        },
        "working_set_bytes": {"per_60s_mean": sum(ws60) / len(ws60), "per_60s_max": max(ws60),
                              "per_600s_max": max(ws600)},
        "concurrency": concurrency,
        "recommended": {
            "gpu_bytes": concurrency["peak_live_kv_bytes"],
            "host_bytes": size_for(0.8),
            "disk_bytes": size_for(0.99),
            "why": "gpu: peak KV of in-flight sequences; host: LRU reaches 80% of the unbounded "
                   "prefix hit rate; disk: 99% of it",
        },
    }

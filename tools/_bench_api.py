"""The plain client API (put, get, get into ``out``) beside the torch copy of the same bytes, in one run.

Each repetition times, back to back, one API call and its reference per 64 MiB batch of 2 MiB
Llama-3-8B blocks, 256 MiB in all:

- ``put(keys, t)`` beside ``warm.copy_(t)`` (a destination already written once);
- ``get(keys)`` beside ``t.clone()``;
- ``get(keys, out=warm)`` beside ``warm.copy_(src)``.

A row's ratio is the median over repetitions of (API GB/s / reference GB/s), each pair measured
beside each other; the reference runs first in even repetitions and second in odd ones.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from _benchd import Daemon

import tierkv

TOTAL_BYTES = 256 << 20
BATCH_BYTES = 64 << 20
GB = 1e9
ROWS = (("put", "put(keys, t)", "warm.copy_(t)"),
        ("get", "get(keys)", "t.clone()"),
        ("get_out", "get(keys, out=warm)", "warm.copy_(src)"))


def _timed(fn: Callable[[int], object], batches: int) -> float:
    """Seconds for ``fn(b)`` over every batch; what it returns stays alive until the clock stops."""
    keep = []
    t = time.perf_counter()
    for b in range(batches):
        keep.append(fn(b))
    return time.perf_counter() - t


def _pair(api: Callable[[int], object], ref: Callable[[int], object], batches: int, ref_first: bool) -> tuple[float, float]:
    if ref_first:
        r = _timed(ref, batches)
        return _timed(api, batches), r
    a = _timed(api, batches)
    return a, _timed(ref, batches)


def _rep(c: tierkv.Client, data: list[torch.Tensor], warm: list[torch.Tensor], rng: np.random.Generator,
         ref_first: bool) -> dict[str, tuple[float, float]]:
    """One repetition: (API seconds, reference seconds) per row; the blocks are deleted at the end."""
    n, bt = len(data), c.layout.block_tokens
    keys = [c.block_keys(rng.integers(0, 50000, t.shape[0] * bt)) for t in data]
    out = {"put": _pair(lambda b: c.put(keys[b], data[b]), lambda b: warm[b].copy_(data[b]), n, ref_first)}
    out["get"] = _pair(lambda b: c.get(keys[b]), lambda b: data[b].clone(), n, ref_first)
    out["get_out"] = _pair(lambda b: c.get(keys[b], out=warm[b]), lambda b: warm[b].copy_(data[b]), n, ref_first)
    for b in range(n):
        assert torch.equal(warm[b].view(torch.int16), data[b].view(torch.int16))
    for k in keys:
        c.delete(k)
    return out


def api_bench(tmp: Path, blocks: torch.Tensor, reps: int, threads: int) -> dict:
    """Figures of the plain API and its torch references (on ``threads`` torch threads, a process's
    default): GB/s per repetition and the ratios."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _measure(tmp, blocks, reps)
    finally:
        torch.set_num_threads(before)


def _measure(tmp: Path, blocks: torch.Tensor, reps: int) -> dict:
    layout = tierkv.Layout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16, dtype="bfloat16")
    per = BATCH_BYTES // layout.block_bytes
    src = blocks[:TOTAL_BYTES // layout.block_bytes].contiguous()
    data = [src[lo:lo + per].clone() for lo in range(0, src.shape[0], per)]
    warm = [torch.zeros_like(t) for t in data]
    d = Daemon(tmp / "api-data", str(tmp / "api.sock"), ["--host-capacity", "1280MiB", "--no-disk"]).start()
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k, _, _ in ROWS}
    try:
        with tierkv.Client.connect(d.sock, model="bench-api", layout=layout) as c:
            rng = np.random.default_rng(7)
            for r in range(reps + 1):  # the first repetition warms caches and is not counted
                got = _rep(c, data, warm, rng, ref_first=r % 2 == 0)
                if r:
                    for k, v in got.items():
                        runs[k].append(v)
    finally:
        d.stop()
    res: dict = {"total_bytes": src.numel() * src.element_size(), "batch_bytes": BATCH_BYTES,
                 "torch_threads": torch.get_num_threads()}
    nbytes = res["total_bytes"]
    for k, api_name, ref_name in ROWS:
        api = [nbytes / a / GB for a, _ in runs[k]]
        ref = [nbytes / r / GB for _, r in runs[k]]
        ratios = [a / r for a, r in zip(api, ref)]
        res[k] = {"api": api_name, "reference": ref_name, "api_gbps": api, "ref_gbps": ref,
                  "ratios": ratios, "ratio": statistics.median(ratios)}
    return res


def report_api(r: dict) -> None:
    """Print the API rows: GB/s (median) of the call and its reference, and the ratio of the two."""
    print(f"\nplain API, {r['total_bytes'] >> 20} MiB in {r['batch_bytes'] >> 20} MiB batches of 2 MiB blocks, "
          f"torch threads {r['torch_threads']}; ratio: median over repetitions of (API / reference beside it)")
    print(f"\n{'call':22} {'GB/s':>7} {'reference':18} {'GB/s':>7} {'ratio':>7}")
    for k, _, _ in ROWS:
        m = r[k]
        print(f"{m['api']:22} {statistics.median(m['api_gbps']):7.2f} {m['reference']:18} "
              f"{statistics.median(m['ref_gbps']):7.2f} {m['ratio']:7.2f}")

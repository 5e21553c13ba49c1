"""Benchmark paged gather/scatter against a plain index_select/index_copy_ of the same bytes.

CPU: tierkv.client.paged.gather/scatter (engine pages <-> tierkv blocks, both engine layouts, batch and
slot-list destinations) versus ``index_select``/``index_copy_`` of whole rows of the same size, in the
same run. CUDA (skipped without a GPU): the one-launch kernel versus ``index_select``/``index_copy_`` on
the device, plus gather into pinned host slots (zero-copy) versus ``index_select`` into a device buffer
followed by a pinned D2H copy.

    python tools/bench_paged.py                 # CPU and, where present, CUDA
    python tools/bench_paged.py --skip-cpu      # the GPU part only

Writes bench-results/bench_paged.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tierkv.client import paged  # noqa: E402


def make_caches(L, H, T, D, NB, layout, device, dtype=torch.bfloat16):
    page = (T, H, D) if layout == "NHD" else (H, T, D)
    torch.manual_seed(0)  # random bits made where they live: gigabytes on a GPU

    def one() -> torch.Tensor:
        return torch.randint(-30000, 30000, (NB, *page), dtype=torch.int16, device=device).view(dtype)

    return [one() for _ in range(L)], [one() for _ in range(L)]


def cpu_time(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cuda_time(fn: Callable[[], object], inner: int = 4) -> float:
    # Several calls between two events so the host-side argument checks overlap the previous copy, as
    # they do in an engine that queues work ahead.
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(inner):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / inner


def paired(device: str, fn: Callable[[], object], ref: Callable[[], object], reps: int) -> tuple[float, float, float]:
    """Median seconds of ``fn`` and ``ref`` and the median of per-pair ratios; the two alternate so that
    load from other processes hits both alike."""
    timer = cuda_time if device == "cuda" else cpu_time
    fn(), ref()
    if device == "cuda":
        torch.cuda.synchronize()
    ours, theirs = [], []
    for _ in range(reps):
        theirs.append(timer(ref))
        ours.append(timer(fn))
    ratio = statistics.median(r / o for o, r in zip(ours, theirs))
    return statistics.median(ours), statistics.median(theirs), ratio


def row(name: str, nbytes: int, timing: tuple[float, float, float]) -> dict:
    t, t_ref, ratio = timing
    gbs, ref = nbytes / t / 1e9, nbytes / t_ref / 1e9
    print(f"  {name:<36} {gbs:8.2f} GB/s   reference {ref:8.2f} GB/s   ratio {ratio:5.2f}x")
    return {"case": name, "bytes": nbytes, "gbps": gbs, "ref_gbps": ref, "ratio": ratio}


def reference_fns(device: str, NB: int, n: int, block_elems: int, ids: torch.Tensor) -> dict[str, Callable]:
    """The same bytes moved as whole contiguous rows (int16, like tierkv's bit views)."""
    src = torch.zeros((NB, block_elems), dtype=torch.int16, device=device)
    dst = torch.zeros((n, block_elems), dtype=torch.int16, device=device)
    refs = {"gather": lambda: torch.index_select(src, 0, ids, out=dst),
            "scatter": lambda: src.index_copy_(0, ids, dst)}
    if device == "cuda":
        # Off the device: index_select into a device buffer + pinned D2H copy, and H2D copy + index_copy_.
        host = torch.empty((n, block_elems), dtype=torch.int16).pin_memory()
        refs["d2h"] = lambda: host.copy_(torch.index_select(src, 0, ids), non_blocking=True)
        refs["h2d"] = lambda: src.index_copy_(0, ids, host.to(device, non_blocking=True))
    return refs


def bench(device: str, L: int, H: int, T: int, D: int, NB: int, n: int, reps: int) -> list[dict]:
    ids_cpu = torch.randperm(NB, generator=torch.Generator().manual_seed(1))[:n]
    refs = reference_fns(device, NB, n, 2 * L * H * T * D, ids_cpu.to(device))
    results = []
    for layout in ("NHD", "HND"):
        results += bench_layout(device, layout, (L, H, T, D, NB, n), ids_cpu, refs, reps)
    return results


def bench_layout(device: str, layout: str, shape: tuple[int, ...], ids_cpu: torch.Tensor, refs: dict,
                 reps: int) -> list[dict]:
    L, H, T, D, NB, n = shape
    nbytes = n * 2 * L * H * T * D * 2
    ks, vs = make_caches(L, H, T, D, NB, layout, device)
    out = torch.empty((n, 2, L, H, T, D), dtype=torch.bfloat16, device=device)
    pool = torch.empty((2 * n, 2, L, H, T, D), dtype=torch.bfloat16, device=device)
    slots = [pool[2 * j + 1] for j in torch.randperm(n, generator=torch.Generator().manual_seed(2)).tolist()]
    # Never report the speed of a wrong copy: check some blocks against plain indexing.
    paged.gather(ks, vs, ids_cpu, out, layout=layout)
    some = ids_cpu[:8].tolist()
    expect = torch.stack([torch.stack([torch.stack([c[b] for c in cs]) for cs in (ks, vs)]) for b in some])
    if layout == "NHD":
        expect = expect.transpose(3, 4)
    assert torch.equal(out[:8].view(torch.int16), expect.view(torch.int16)), "gather result is wrong"
    results = []
    for tag, dst in (("batch", out), ("slots", slots)):
        timing = paired(device, lambda dst=dst: paged.gather(ks, vs, ids_cpu, dst, layout=layout),
                        refs["gather"], reps)
        results.append(row(f"{device} gather {layout} -> {tag}", nbytes, timing) | {"op": "gather"})
        timing = paired(device, lambda dst=dst: paged.scatter(dst, ks, vs, ids_cpu, layout=layout),
                        refs["scatter"], reps)
        results.append(row(f"{device} scatter {layout} <- {tag}", nbytes, timing) | {"op": "scatter"})
    if device == "cuda":
        del pool, slots
        pinned_pool = torch.empty((2 * n, 2, L, H, T, D), dtype=torch.bfloat16).pin_memory()
        host_slots = [pinned_pool[2 * j + 1] for j in range(n)]
        timing = paired(device, lambda: paged.gather(ks, vs, ids_cpu, host_slots, layout=layout), refs["d2h"], reps)
        results.append(row(f"cuda gather {layout} -> pinned host slots", nbytes, timing) | {"op": "d2h"})
        timing = paired(device, lambda: paged.scatter(host_slots, ks, vs, ids_cpu, layout=layout), refs["h2d"], reps)
        results.append(row(f"cuda scatter {layout} <- pinned host slots", nbytes, timing) | {"op": "h2d"})
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--cpu-engine-blocks", type=int, default=128)
    ap.add_argument("--cpu-blocks", type=int, default=32)
    ap.add_argument("--gpu-engine-blocks", type=int, default=2048)
    ap.add_argument("--gpu-blocks", type=int, default=512)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the same for both sides)")
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--out", default="bench-results/bench_paged.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    geo = (args.layers, args.heads, args.tokens, args.head_dim)
    block_mib = 2 * args.layers * args.heads * args.tokens * args.head_dim * 2 / 2**20
    print(f"block: L={args.layers} H={args.heads} T={args.tokens} D={args.head_dim} bf16 = {block_mib:.2f} MiB")
    report = {"geometry": dict(zip(("layers", "heads", "tokens", "head_dim"), geo)), "dtype": "bfloat16",
              "block_mib": block_mib, "machine": platform.machine(), "cpu_count": os.cpu_count(),
              "torch": torch.__version__, "threads": args.threads, "results": []}
    if not args.skip_cpu:
        print(f"CPU ({args.threads} thread(s)), {args.cpu_blocks} of {args.cpu_engine_blocks} blocks per call:")
        report["results"] += bench("cpu", *geo, args.cpu_engine_blocks, args.cpu_blocks, args.reps)
    if torch.cuda.is_available():
        report["gpu"] = torch.cuda.get_device_name()
        report["kernel_backend"] = paged.kernel_backend()
        print(f"CUDA ({report['gpu']}, kernel via {report['kernel_backend']}), "
              f"{args.gpu_blocks} of {args.gpu_engine_blocks} blocks per call:")
        report["results"] += bench("cuda", *geo, args.gpu_engine_blocks, args.gpu_blocks, max(args.reps, 10))
    else:
        print("CUDA: not available, GPU part skipped")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

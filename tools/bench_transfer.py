#!/usr/bin/env python3
"""The transfer engine's promises, each beside its reference measured in the same run.

(a) Stores never wait for cold tiers: with the host tier already full, ``put`` of 512 MiB against the
    memcpy time of the same bytes, while write-back to disk goes on behind it; the
    same put with write-behind off shows what waiting for the disk costs.
(b) Prefetch hides the disk: after ``prefetch`` and a wait as long as a disk read of the same bytes
    takes, ``get`` against a host-tier ``get`` of those blocks.
(c) Bandwidth budget: a compute loop in the client, alone, beside unlimited offload traffic, and beside
    offload capped by ``budget.host_disk``; the link's measured rate against the cap.
(d) GPU tier: on CUDA, H2D and D2H through tierkv against a plain pinned torch copy of the same bytes
    and a D2D store from an engine tensor into GPU slots against a D2D copy; without
    CUDA, the same paths through the CPU stand-in against memcpy (labelled stand-in).
    (The paged gather/scatter kernel against index_copy_ is tools/bench_paged.py.)

Usage: python tools/bench_transfer.py [--json bench-results/bench_transfer.json] [--skip a,b,c,d]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _benchd import Daemon  # noqa: E402  (tools/ is the script's directory)

import tierkv  # noqa: E402

LLAMA = tierkv.Layout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16, dtype="bfloat16")
BB = LLAMA.block_bytes  # 2 MiB
GB = 1e9


def keys(c: tierkv.Client, n: int, seed: int) -> list[bytes]:
    return c.block_keys(np.random.default_rng(seed).integers(0, 50000, n * LLAMA.block_tokens))


def memcpy_s(nbytes: int, reps: int = 3) -> float:
    """Best time of one numpy copy of ``nbytes`` (both buffers touched first)."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return best


def wait_until(pred, timeout: float, poll: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(poll)
    return False


def drop_cache(path: Path) -> None:
    """Evict a directory's files from the page cache, so the next reads come from the device."""
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ---- (a) stores never wait ---------------------------------------------------------------------------
def bench_store(tmp: Path, blocks: torch.Tensor, write_behind: bool, reps: int) -> dict:
    """Bursts of 512 MiB puts into a full 1 GiB host tier, each paired with a memcpy of the same bytes."""
    n = blocks.shape[0]  # 256 blocks = 512 MiB
    tag = "wb" if write_behind else "nowb"
    d = Daemon(tmp / f"a-{tag}", str(tmp / f"a-{tag}.sock"),
               ["--host-capacity", "1GiB", "--disk-capacity", "16GiB"],
               env={"TIERKV_DISK_ADMISSION": "all", "TIERKV_HOST_WRITE_BEHIND": "1" if write_behind else "0"}).start()
    src = np.random.default_rng(0).integers(0, 255, n * BB, dtype=np.uint8)
    dst = np.zeros_like(src)
    rows = []
    try:
        with tierkv.Client.connect(d.sock, model="bench", layout=LLAMA) as c:
            c.put(keys(c, n, 1), blocks)   # fill the host tier: 1 GiB of 2 MiB blocks
            c.put(keys(c, n, 2), blocks)
            for r in range(reps):
                if write_behind:  # let the cleaner catch up, as it does between bursts
                    want = (2 + r) * n - 16
                    wait_until(lambda: c.stats()["tiers"]["disk"]["blocks"] >= want, 120)  # noqa: B023
                before = c.stats()["tiers"]
                t = time.perf_counter()
                np.copyto(dst, src)
                memcpy = time.perf_counter() - t
                t = time.perf_counter()
                c.put(keys(c, n, 3 + r), blocks)   # the burst
                put_s = time.perf_counter() - t
                during = c.stats()["tiers"]
                rows.append({"memcpy_s": memcpy, "put_s": put_s, "ratio": put_s / memcpy,
                             "host_used_before": before["host"]["used_bytes"],
                             "disk_blocks_before": before["disk"]["blocks"],
                             "disk_blocks_at_return": during["disk"]["blocks"]})
            wait_until(lambda: c.stats()["transfer"]["inflight"] == 0, 120)
            after = c.stats()["tiers"]
        ratios = [x["ratio"] for x in rows]
        return {"bursts": rows, "ratio_median": statistics.median(ratios), "ratio_best": min(ratios),
                "host_capacity": after["host"]["capacity_bytes"], "disk_blocks_after": after["disk"]["blocks"],
                "written_behind": after["disk"]["written_behind"]}
    finally:
        d.stop()


# ---- (b) prefetch hides the disk -----------------------------------------------------------------------
def bench_prefetch(tmp: Path, blocks: torch.Tensor) -> dict:
    n = blocks.shape[0] // 2  # 128 blocks = 256 MiB per set
    data = tmp / "b"
    args = ["--host-capacity", "2GiB", "--disk-capacity", "8GiB"]
    d = Daemon(data, str(tmp / "b.sock"), args).start()
    with tierkv.Client.connect(d.sock, model="bench", layout=LLAMA) as c:
        ka, kb, kc = keys(c, n, 10), keys(c, n, 11), keys(c, n, 12)
        for k in (ka, kb, kc):
            c.put(k, blocks[:n], durable=True)
    d.stop()
    drop_cache(data)
    d = Daemon(data, str(tmp / "b.sock"), args).start()
    try:
        with tierkv.Client.connect(d.sock, model="bench", layout=LLAMA) as c:
            out = torch.empty(LLAMA.batch_shape(n), dtype=LLAMA.torch_dtype)
            c.get(kc[:4], out=out[:4])  # warm the client path
            drop_cache(data)
            t = time.perf_counter()
            c.get(ka, out=out)
            disk_s = time.perf_counter() - t
            assert c.prefetch(kb) == n
            time.sleep(disk_s)  # the engine does other work for as long as a disk read takes
            t = time.perf_counter()
            c.get(kb, out=out)
            prefetched_s = time.perf_counter() - t
            host = []
            for _ in range(3):
                t = time.perf_counter()
                c.get(kb, out=out)
                host.append(time.perf_counter() - t)
            host_s = statistics.median(host)
        return {"bytes": n * BB, "disk_get_s": disk_s, "prefetched_get_s": prefetched_s, "host_get_s": host_s}
    finally:
        d.stop()


# ---- (c) budgets -----------------------------------------------------------------------------------------
def compute_rate(seconds: float) -> float:
    """Iterations/s of a decode-like loop: small matmuls plus a memory-bound copy, one torch thread."""
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    w = torch.randn(256, 256)
    buf = torch.empty(8 << 20, dtype=torch.uint8)
    src = torch.randint(0, 255, (8 << 20,), dtype=torch.uint8)
    end = time.perf_counter() + seconds
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() < end:
        a = torch.tanh(a @ w)
        buf.copy_(src)
        n += 1
    return n / (time.perf_counter() - t0)


def _offload(sock: str, stop: mp.Event) -> None:
    """Another engine's offload traffic: fresh blocks into a small host tier, so write-back never stops."""
    torch.set_num_threads(1)
    blocks = torch.randn(LLAMA.batch_shape(8)).to(torch.bfloat16)
    with tierkv.Client.connect(sock, model="offload", layout=LLAMA) as c:
        seed = 100
        while not stop.is_set():
            c.put(keys(c, 8, seed), blocks)
            seed += 1


def bench_budget(tmp: Path, seconds: float, cap: int) -> dict:
    d = Daemon(tmp / "c", str(tmp / "c.sock"), ["--host-capacity", "256MiB", "--disk-capacity", "32GiB",
                                                 "--disk-workers", "1"],
               env={"TIERKV_DISK_ADMISSION": "all"}).start()
    ctx = mp.get_context("spawn")
    res: dict = {"cap_bytes_per_s": cap}
    try:
        res["alone"] = compute_rate(seconds)
        with tierkv.Client.connect(d.sock, model="probe2", layout=LLAMA, populate=False) as c:
            for label, rate in (("unlimited", 0), ("budget", cap)):
                c._call(tierkv.client.client.Op.TUNE, {"settings": {"budget.host_disk": rate}})
                stop = ctx.Event()
                p = ctx.Process(target=_offload, args=(d.sock, stop))
                p.start()
                time.sleep(3)  # the host tier fills; write-back runs from here on
                # bytes that crossed the link (encoded, as the budget counts them)
                b0 = c.stats()["transfer"]["links"]["host<->disk"]["bytes"]
                t0 = time.perf_counter()
                res[label] = compute_rate(seconds)
                res[label + "_link_bytes_per_s"] = (c.stats()["transfer"]["links"]["host<->disk"]["bytes"] - b0) / (
                    time.perf_counter() - t0)
                stop.set()
                p.join(60)
                if p.is_alive():
                    p.kill()
                wait_until(lambda: c.stats()["transfer"]["inflight"] == 0, 60)
        return res
    finally:
        d.stop()


# ---- (d) GPU tier ------------------------------------------------------------------------------------------
def gpu_reference(src: torch.Tensor, engine: torch.Tensor, cuda: bool) -> dict[str, float]:
    """GB/s of plain torch copies of the same bytes: pinned H2D and D2H and D2D on CUDA, memcpy without."""
    nbytes = src.numel() * src.element_size()
    if not cuda:
        m = nbytes / memcpy_s(nbytes) / GB
        return {"h2d": m, "d2h": m, "d2d": m}
    pinned = torch.empty_like(src).pin_memory()
    pinned.copy_(src)
    dst_dev = torch.empty_like(engine)
    ref = {}
    for name, fn in (("h2d", lambda: dst_dev.copy_(pinned, non_blocking=True)),
                     ("d2h", lambda: pinned.copy_(dst_dev, non_blocking=True)),
                     ("d2d", lambda: dst_dev.copy_(engine))):
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        ref[name] = nbytes / best / GB
    return ref


def gpu_rounds(c: tierkv.Client, engine: torch.Tensor, cuda: bool, rounds: int = 3) -> dict[str, list[float]]:
    """GB/s per round of a D2D store into GPU slots, its drain to host slots and a promotion back."""
    n = engine.shape[0]
    nbytes = n * BB
    sync = (lambda: torch.cuda.synchronize()) if cuda else (lambda: None)
    got: dict[str, list[float]] = {"d2d_store": [], "d2h_drain": [], "h2d_promote": []}
    for r in range(rounds):
        k = keys(c, n, 500 + r)
        sync()
        t = time.perf_counter()
        c.put(k, engine, tier="gpu")          # engine tensor -> GPU slots, then commit
        got["d2d_store"].append(nbytes / (time.perf_counter() - t) / GB)
        t = time.perf_counter()
        with c.acquire(k) as lease:  # a host lease waits for the drain: GPU -> pinned host slots
            assert lease.count == n
        got["d2h_drain"].append(nbytes / (time.perf_counter() - t) / GB)
        # make the GPU copies go away (another batch of the same size evicts them), then promote
        c.put(keys(c, n, 900 + r), engine, tier="gpu")
        c.put(keys(c, n, 950 + r), engine, tier="gpu")
        wait_until(lambda: c.stats()["tiers"]["gpu"]["draining"] == 0, 120)
        assert c.lookup_tiers(k)[0] == "host"
        t = time.perf_counter()
        with c.wait(c.fetch(k, tier="gpu"), timeout=None) as lease:  # pinned host -> GPU slots
            assert lease.count == n
        got["h2d_promote"].append(nbytes / (time.perf_counter() - t) / GB)
    return got


def bench_gpu(tmp: Path, blocks: torch.Tensor) -> dict:
    cuda = torch.cuda.is_available()
    n = 128  # 256 MiB
    src = blocks[:n]
    d = Daemon(tmp / "d", str(tmp / "d.sock"), ["--host-capacity", "1GiB", "--disk-capacity", "4GiB",
                                                "--gpu-capacity", "512MiB", "--gpu-device", "cuda" if cuda else "cpu"]
               ).start()
    res: dict = {"kind": "cuda" if cuda else "standin", "bytes": n * BB}
    try:
        with tierkv.Client.connect(d.sock, model="bench", layout=LLAMA) as c:
            engine = src.to(c.gpu_device)
            ref = res["reference_GBps"] = gpu_reference(src, engine, cuda)
            got = gpu_rounds(c, engine, cuda)
            res["tierkv_GBps"] = {k: max(v) for k, v in got.items()}
            res["all"] = got
            res["ratio"] = {"h2d": res["tierkv_GBps"]["h2d_promote"] / ref["h2d"],
                            "d2h": res["tierkv_GBps"]["d2h_drain"] / ref["d2h"],
                            "d2d": res["tierkv_GBps"]["d2d_store"] / ref["d2d"]}
            res["host_pinned"] = c.stats()["tiers"]["gpu"]["host_pinned"]
        return res
    finally:
        d.stop()


def run_sections(args: argparse.Namespace, skip: set[str], base: Path, blocks: torch.Tensor, out: dict) -> None:
    """Run the sections not in ``skip``, print one line each and add their figures to ``out``."""
    from tierkv.core.units import parse_size

    if "a" not in skip:
        wb = bench_store(base, blocks, True, args.reps)
        nowb = bench_store(base, blocks, False, 1)
        out["a"] = {"write_behind": wb, "no_write_behind": nowb}
        b0 = wb["bursts"][0]
        print(f"(a) put 512 MiB into a full host tier, {args.reps} bursts: median {wb['ratio_median']:.2f}x, best "
              f"{wb['ratio_best']:.2f}x the paired memcpy (e.g. {b0['put_s'] * 1e3:.0f} vs {b0['memcpy_s'] * 1e3:.0f}"
              f" ms); write-behind off: {nowb['ratio_median']:.2f}x; disk blocks "
              f"{b0['disk_blocks_before']} before a burst, {b0['disk_blocks_at_return']} at its return, "
              f"{wb['disk_blocks_after']} after (write-back behind the puts)", flush=True)
    if "b" not in skip:
        b = bench_prefetch(base, blocks)
        b["ratio"] = b["prefetched_get_s"] / b["host_get_s"]
        out["b"] = b
        print(f"(b) get 256 MiB: cold from disk {b['disk_get_s'] * 1e3:.0f} ms; after prefetch + "
              f"{b['disk_get_s'] * 1e3:.0f} ms wait {b['prefetched_get_s'] * 1e3:.0f} ms; host-tier get "
              f"{b['host_get_s'] * 1e3:.0f} ms -> {b['ratio']:.2f}x", flush=True)
    if "c" not in skip:
        c = bench_budget(base, args.seconds, parse_size(args.cap))
        unl_loss = 1 - c["unlimited"] / c["alone"]
        bud_loss = 1 - c["budget"] / c["alone"]
        share = c["cap_bytes_per_s"] / max(c["unlimited_link_bytes_per_s"], 1)
        c.update({"loss_unlimited": unl_loss, "loss_budget": bud_loss, "budget_share_of_unlimited": share,
                  "link_vs_cap": c["budget_link_bytes_per_s"] / c["cap_bytes_per_s"]})
        out["c"] = c
        print(f"(c) compute loop: alone {c['alone']:.1f} it/s; with unlimited offload {c['unlimited']:.1f} "
              f"({-unl_loss:+.0%}, link {c['unlimited_link_bytes_per_s'] / 1e6:.0f} MB/s); with budget "
              f"{c['cap_bytes_per_s'] / 1e6:.0f} MB/s {c['budget']:.1f} ({-bud_loss:+.0%}, link "
              f"{c['budget_link_bytes_per_s'] / 1e6:.0f} MB/s = {c['link_vs_cap']:.2f}x the cap; the cap is "
              f"{share:.0%} of the unlimited rate)", flush=True)
    if "d" not in skip:
        g = bench_gpu(base, blocks)
        out["d"] = g
        print(f"(d) GPU tier ({g['kind']}): " + ", ".join(
            f"{k} {g['tierkv_GBps'][t]:.2f} GB/s vs {g['reference_GBps'][k]:.2f} = {g['ratio'][k]:.2f}x"
            for k, t in (("h2d", "h2d_promote"), ("d2h", "d2h_drain"), ("d2d", "d2d_store"))), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="bench-results/bench_transfer.json")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip (a,b,c,d)")
    ap.add_argument("--reps", type=int, default=5, help="bursts in section (a)")
    ap.add_argument("--seconds", type=float, default=8.0, help="compute loop duration per budget case")
    ap.add_argument("--cap", default="64MiB", help="budget.host_disk for section (c)")
    ap.add_argument("--tmp", default=None, help="work directory (default: a temp dir next to the repo)")
    args = ap.parse_args()
    skip = set(args.skip.split(",")) - {""}
    base = Path(args.tmp or tempfile.mkdtemp(prefix="bench-transfer-", dir=Path(__file__).resolve().parents[1]))
    base.mkdir(parents=True, exist_ok=True)
    blocks = torch.randn(LLAMA.batch_shape(256), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out: dict = {"machine": {"cpus": os.cpu_count(), "cuda": torch.cuda.is_available()}}
    try:
        run_sections(args, skip, base, blocks, out)
    finally:
        import shutil

        if not args.tmp:
            shutil.rmtree(base, ignore_errors=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

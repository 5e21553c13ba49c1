#!/usr/bin/env python3
"""Host and disk tier throughput and lookup latency, each beside its reference measured in the same run.

(a) numpy memcpy bandwidth (one 512 MiB copy, and the same bytes as 2 MiB copies);
(b) host-tier put/get through the client, 256 blocks of a Llama-3-8B layout (32 layers, 8 kv heads,
    head dim 128, 16 tokens, bf16: 2 MiB a block);
(c) dd oflag=direct / iflag=direct sequential write/read of the data dir's disk;
(d) disk-tier write (durable puts: encoded, written, fsynced) and read (promotion from disk, cold after
    dropping the page cache of the LMDB file, and warm) in logical bytes through the client;
(e) lookup latency p50/p99 for 64-key batches with 1 and 8 concurrent client processes.

Usage: python tools/bench_tiers.py [--reps 5] [--json bench-results/bench_tiers.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tierkv  # noqa: E402

LLAMA = tierkv.Layout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16, dtype="bfloat16")
N = 256
GB = 1e9
SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "data" / "kv-sample"


def kv_blocks(n: int) -> torch.Tensor:
    """Real KV bytes (SmolLM2 keys and values cast to bf16) laid out as ``n`` Llama-3-8B blocks."""
    try:
        k = np.load(SAMPLE / "k.npy", mmap_mode="r")
        v = np.load(SAMPLE / "v.npy", mmap_mode="r")
        flat = torch.from_numpy(np.concatenate([np.asarray(k).reshape(-1), np.asarray(v).reshape(-1)]))
        flat = flat.float().to(torch.bfloat16)
        source = "real SmolLM2 KV (kv-sample) cast to bf16"
    except OSError:
        flat = torch.randn(1 << 22).to(torch.bfloat16)
        source = "random normal bf16 (kv-sample not found)"
    need = n * LLAMA.block_elems
    reps = -(-need // flat.numel())
    out = flat.repeat(reps)[:need].reshape(LLAMA.batch_shape(n)).contiguous()
    kv_blocks.source = source  # type: ignore[attr-defined]
    return out


def best_median(xs: list[float]) -> dict:
    return {"best": max(xs), "median": statistics.median(xs), "all": xs}


def memcpy_ref(reps: int) -> dict:
    src = np.random.default_rng(0).integers(0, 255, N * LLAMA.block_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = 0
    bulk, pieces = [], []
    bb = LLAMA.block_bytes
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        bulk.append(src.nbytes / (time.perf_counter() - t) / GB)
        t = time.perf_counter()
        for i in range(N):
            np.copyto(dst[i * bb:(i + 1) * bb], src[i * bb:(i + 1) * bb])
        pieces.append(src.nbytes / (time.perf_counter() - t) / GB)
    return {"bulk": best_median(bulk), "pieces_2mib": best_median(pieces)}


class Daemon:
    def __init__(self, data_dir: Path, sock: str, args: list[str]) -> None:
        self.cmd = [sys.executable, "-m", "tierkv", "serve", "--socket", sock, "--data-dir", str(data_dir),
                    "--log-level", "warning", *args]
        self.sock = sock
        self.proc: subprocess.Popen | None = None

    def start(self) -> Daemon:
        self.proc = subprocess.Popen(self.cmd, stderr=subprocess.PIPE)
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(self.proc.stderr.read().decode())  # type: ignore[union-attr]
            try:
                tierkv.Client.connect(self.sock, model="probe", layout=LLAMA, populate=False).close()
                return self
            except tierkv.TierKVError:
                time.sleep(0.1)
        raise RuntimeError("daemon did not start")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(120)


def host_bench(tmp: Path, blocks: torch.Tensor, reps: int) -> dict:
    d = Daemon(tmp / "host-data", str(tmp / "h.sock"), ["--host-capacity", "1280MiB", "--no-disk"]).start()
    try:
        with tierkv.Client.connect(d.sock, model="bench", layout=LLAMA) as c:
            rng = np.random.default_rng(1)
            out = torch.empty_like(blocks)
            puts, gets = [], []
            for r in range(reps + 1):  # first round warms caches and is not counted
                keys = c.block_keys(rng.integers(0, 50000, N * 16))
                t = time.perf_counter()
                c.put(keys, blocks)
                tp = time.perf_counter() - t
                t = time.perf_counter()
                c.get(keys, out=out)
                tg = time.perf_counter() - t
                assert torch.equal(out.view(torch.int16), blocks.view(torch.int16))
                c.delete(keys)
                if r:
                    puts.append(blocks.numel() * 2 / tp / GB)
                    gets.append(blocks.numel() * 2 / tg / GB)
        return {"put": best_median(puts), "get": best_median(gets)}
    finally:
        d.stop()


def dd_ref(path: Path, reps: int) -> dict:
    f = path / "dd.bin"
    w, r = [], []
    rate = re.compile(r"copied, ([0-9.]+) s")
    for _ in range(reps):
        p = subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=1M", "count=512", "oflag=direct", "conv=fsync"],
                           capture_output=True, text=True, check=True)
        w.append((512 << 20) / float(rate.search(p.stderr).group(1)) / GB)
        p = subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=1M", "iflag=direct"],
                           capture_output=True, text=True, check=True)
        r.append((512 << 20) / float(rate.search(p.stderr).group(1)) / GB)
        f.unlink()
    return {"write": best_median(w), "read": best_median(r)}


_LMDB_REF = r"""
import lmdb, os, sys, time, numpy as np
d, reps = sys.argv[1], int(sys.argv[2])
vals = [np.random.default_rng(i).integers(0, 255, 2 << 20, dtype=np.uint8).tobytes() for i in range(24)]
env = lmdb.open(d, map_size=2 << 30, sync=True, metasync=True, readahead=False, meminit=False)
env.close()
fd = os.open(d + "/data.mdb", os.O_RDWR); os.posix_fallocate(fd, 0, 2 << 30); os.close(fd)
env = lmdb.open(d, map_size=2 << 30, sync=True, metasync=True, readahead=False, meminit=False)
out = []
for r in range(reps):
    t = time.perf_counter()
    for b in range(8):  # 8 transactions of 24 x 2 MiB (48 MiB), as the disk writer batches
        with env.begin(write=True) as txn:
            for j in range(24):
                txn.put(b"%d-%d-%d" % (r, b, j), vals[j])
    out.append(8 * 24 * (2 << 20) / (time.perf_counter() - t) / 1e9)
    with env.begin(write=True) as txn:
        for b in range(8):
            for j in range(24):
                txn.delete(b"%d-%d-%d" % (r, b, j))
print(" ".join(map(str, out)))
"""


def lmdb_ref(tmp: Path, reps: int) -> dict:
    """LMDB alone: durable put+commit of 2 MiB values into a preallocated file, with the daemon's allocator
    tunables. The ceiling of any LMDB-backed tier on this disk."""
    from tierkv.cli import _TUNABLES

    d = tmp / "lmdb-ref"
    d.mkdir()
    env = dict(os.environ, GLIBC_TUNABLES=_TUNABLES)
    out = subprocess.run([sys.executable, "-c", _LMDB_REF, str(d), str(reps)], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    shutil.rmtree(d, ignore_errors=True)
    return {"write": best_median([float(x) for x in out])}


def disk_bench(tmp: Path, blocks: torch.Tensor, reps: int, codec: str) -> dict:
    data = tmp / f"disk-{codec}"
    sock = str(tmp / f"d-{codec}.sock")
    args = ["--host-capacity", "1280MiB", "--disk-capacity", "8GiB", "--codec", codec]
    writes, fills, cold, warm = [], [], [], []
    ratio = None
    rng = np.random.default_rng(2)
    for _ in range(reps):
        d = Daemon(data, sock, args).start()
        with tierkv.Client.connect(sock, model="bench", layout=LLAMA) as c:
            # First fill: LMDB extends into fresh (preallocated, never written) file extents.
            fill = c.block_keys(rng.integers(0, 50000, N * 16))
            t = time.perf_counter()
            for i in range(0, N, 64):
                c.put(fill[i:i + 64], blocks[i:i + 64], durable=True)
            fills.append(blocks.numel() * 2 / (time.perf_counter() - t) / GB)
            c.delete(fill)  # a full cache evicts: the next writes reuse these pages (steady state)
            keys = c.block_keys(rng.integers(0, 50000, N * 16))
            t = time.perf_counter()
            for i in range(0, N, 64):  # durable: returns once encoded, written and fsynced
                c.put(keys[i:i + 64], blocks[i:i + 64], durable=True)
            writes.append(blocks.numel() * 2 / (time.perf_counter() - t) / GB)
            ratio = c.stats()["tiers"]["disk"]["compression_ratio"]
            c.delete(keys)  # leave nothing in host: the next daemon reads only from disk
            c.put(keys, blocks, durable=True)
        d.stop()
        d = Daemon(data, sock, args).start()
        _drop_cache(data / "disk" / "data.mdb")
        out = torch.empty_like(blocks)
        with tierkv.Client.connect(sock, model="bench", layout=LLAMA) as c:
            assert c.lookup_tiers(keys) == ["disk"] * N
            t = time.perf_counter()
            for i in range(0, N, 64):
                c.get(keys[i:i + 64], out=out[i:i + 64])
            cold.append(blocks.numel() * 2 / (time.perf_counter() - t) / GB)
            assert torch.equal(out.view(torch.int16), blocks.view(torch.int16))
        d.stop()
        d = Daemon(data, sock, args).start()  # page cache now holds the file: a warm read
        with tierkv.Client.connect(sock, model="bench", layout=LLAMA) as c:
            t = time.perf_counter()
            for i in range(0, N, 64):
                c.get(keys[i:i + 64], out=out[i:i + 64])
            warm.append(blocks.numel() * 2 / (time.perf_counter() - t) / GB)
            c.delete(keys)
        d.stop()
    return {"codec": codec, "ratio": ratio, "write": best_median(writes), "first_fill": best_median(fills),
            "read_cold": best_median(cold),
            "read_warm": best_median(warm)}


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _lookup_worker(sock: str, keys: list[bytes], n: int, rate: float, q) -> None:
    """``rate`` 0: back-to-back (closed loop); else paced at ``rate`` lookups/s like an engine's scheduler."""
    with tierkv.Client.connect(sock, model="bench", layout=LLAMA, populate=False) as c:
        for _ in range(50):
            c.lookup(keys)
        lat = []
        nxt = time.perf_counter()
        for _ in range(n):
            if rate:
                nxt += np.random.exponential(1.0 / rate)
                delay = nxt - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            t = time.perf_counter()
            assert c.lookup(keys) == len(keys)
            lat.append(time.perf_counter() - t)
    q.put(lat)


def lookup_bench(tmp: Path, blocks: torch.Tensor) -> dict:
    d = Daemon(tmp / "lk-data", str(tmp / "l.sock"), ["--host-capacity", "256MiB", "--no-disk"]).start()
    try:
        with tierkv.Client.connect(d.sock, model="bench", layout=LLAMA) as c:
            keys = c.block_keys(np.arange(64 * 16))
            c.put(keys, blocks[:64])  # every lookup walks 64 cached blocks
        res = {}
        ctx = mp.get_context("spawn")
        for nclients, rate in ((1, 0), (8, 0), (1, 500), (8, 500)):
            q = ctx.Queue()
            ps = [ctx.Process(target=_lookup_worker, args=(d.sock, keys, 2000, rate, q)) for _ in range(nclients)]
            for p in ps:
                p.start()
            lat = sorted(x for _ in ps for x in q.get(timeout=300))
            for p in ps:
                p.join()
            name = f"{nclients} client{'s' if nclients > 1 else ''}, " + (f"paced {rate}/s each" if rate else "back-to-back")
            res[name] = {"p50_us": lat[len(lat) // 2] * 1e6, "p99_us": lat[int(len(lat) * 0.99)] * 1e6,
                         "samples": len(lat)}
        return res
    finally:
        d.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="bench-results/bench_tiers.json")
    ap.add_argument("--dir", default=None, help="where the data dirs go (default: a temp dir under ./.tierkv)")
    ap.add_argument("--codecs", default="lossless,raw")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = Path(args.dir or ".tierkv")
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = Path(tempfile.mkdtemp(prefix="bench-", dir=base))
    os.chmod(tmp, 0o700)
    try:
        blocks = kv_blocks(N)
        res: dict = {"blocks": N, "block_bytes": LLAMA.block_bytes, "data": kv_blocks.source}  # type: ignore
        print(f"data: {N} x {LLAMA.block_bytes >> 20} MiB blocks, {res['data']}", flush=True)
        res["memcpy"] = memcpy_ref(args.reps)
        print("memcpy done", flush=True)
        res["host"] = host_bench(tmp, blocks, args.reps)
        print("host done", flush=True)
        res["dd"] = dd_ref(tmp, args.reps)
        res["lmdb"] = lmdb_ref(tmp, args.reps)
        print("dd and lmdb done", flush=True)
        res["disk"] = [disk_bench(tmp, blocks, max(2, args.reps // 2), c) for c in args.codecs.split(",")]
        print("disk done", flush=True)
        res["lookup"] = lookup_bench(tmp, blocks)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(res)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.json}")


def report(r: dict) -> None:
    mc = r["memcpy"]["bulk"]["best"]
    ddw, ddr = r["dd"]["write"]["best"], r["dd"]["read"]["best"]
    rows = [("memcpy 512 MiB (reference)", r["memcpy"]["bulk"], mc, None),
            ("memcpy in 2 MiB pieces", r["memcpy"]["pieces_2mib"], mc, None),
            ("host put (client, 256 x 2 MiB)", r["host"]["put"], mc, 0.8),
            ("host get (client, 256 x 2 MiB)", r["host"]["get"], mc, 0.8),
            ("dd oflag=direct write (reference)", r["dd"]["write"], ddw, None),
            ("dd iflag=direct read (reference)", r["dd"]["read"], ddr, None),
            ("LMDB alone: durable put+commit, raw 2 MiB", r["lmdb"]["write"], ddw, None)]
    for d in r["disk"]:
        rows += [(f"disk write durable, first fill, {d['codec']}", d["first_fill"], ddw, None),
                 (f"disk write durable, steady, {d['codec']} ({d['ratio']:.2f}x)", d["write"], ddw, 1.0),
                 (f"disk read cold (page cache dropped), {d['codec']}", d["read_cold"], ddr, 1.0),
                 (f"disk read warm (page cache), {d['codec']}", d["read_warm"], ddr, None)]
    print(f"\n{'measure':48} {'GB/s best':>10} {'median':>8} {'ratio':>7} {'target':>8}")
    for name, m, ref, target in rows:
        ratio = m["best"] / ref
        t = "" if target is None else (f">={target}x " + ("ok" if ratio >= target else "MISS"))
        print(f"{name:48} {m['best']:10.2f} {m['median']:8.2f} {ratio:7.2f} {t:>8}")
    print(f"\n{'lookup, 64-key batch':48} {'p50 us':>10} {'p99 us':>8}   target p50<=200 p99<=1000")
    for k, v in r["lookup"].items():
        ok = "ok" if v["p50_us"] <= 200 and v["p99_us"] <= 1000 else "MISS"
        print(f"{k:48} {v['p50_us']:10.1f} {v['p99_us']:8.1f}   {ok}")


if __name__ == "__main__":
    main()

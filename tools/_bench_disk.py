"""The disk tier's benchmark and its references: dd of the same disk, LMDB alone, the codecs alone.

Used by bench_tiers.py (parts c and d of its docstring).
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from _bench_common import GB, LLAMA, N, best_median
from _benchd import Daemon

import tierkv
from tierkv.movers.engine import LOAD_THREADS

_DD_RATE = re.compile(r"copied, ([0-9.]+) s")


def dd(f: Path, op: str, src: Path | None = None) -> float:
    """GB/s of one ``dd`` of 512 MiB: ``write`` (oflag=direct, conv=fsync) or ``read`` (iflag=direct).

    ``src``: write these bytes (a file in /dev/shm) instead of /dev/zero. The virtual disk here writes
    zeros faster than data (measured: 2.2-2.7 vs 1.4-1.8 GB/s), so the tier is also compared with ``dd``
    of the very KV bytes it stores."""
    source = str(src) if src is not None else "/dev/zero"
    cmd = (["dd", f"if={source}", f"of={f}", "bs=1M", "count=512", "oflag=direct", "conv=fsync"] if op == "write"
           else ["dd", f"if={f}", "of=/dev/null", "bs=1M", "iflag=direct"])
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return (512 << 20) / float(_DD_RATE.search(p.stderr).group(1)) / GB


SETTLE_S = 1.0


def _settle() -> None:
    """Flush dirty pages and pause: the virtual disk finishes writing what the last run left in its cache."""
    os.sync()
    time.sleep(SETTLE_S)


def _settled(fn, *args):
    _settle()
    return fn(*args)


def dd_ref(path: Path, reps: int) -> dict:
    f = path / "dd.bin"
    w, r = [], []
    for _ in range(reps):
        w.append(dd(f, "write"))
        r.append(dd(f, "read"))
        f.unlink()
    return {"write": best_median(w), "read": best_median(r)}


_LMDB_REF = r"""
import ctypes, lmdb, os, sys, threading, time, numpy as np
d, reps = sys.argv[1], int(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)
libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
committing = threading.Event()
def kick():  # as the tier does: start writeback while a commit copies its pages
    fd = os.open(d + "/data.mdb", os.O_RDONLY)
    while True:
        committing.wait()
        libc.sync_file_range(fd, 0, 0, 2)
        time.sleep(0.0005)
vals = [np.random.default_rng(i).integers(0, 255, 2 << 20, dtype=np.uint8).tobytes() for i in range(24)]
opts = dict(map_size=2 << 30, sync=True, metasync=False, readahead=False, meminit=False)
env = lmdb.open(d, **opts)
env.close()
fd = os.open(d + "/data.mdb", os.O_RDWR); os.posix_fallocate(fd, 0, 2 << 30); os.close(fd)
env = lmdb.open(d, **opts)
threading.Thread(target=kick, daemon=True).start()
out, cpu = [], []
for r in range(reps + 1):  # the first pass writes into fresh extents (the tier's first fill): not counted
    c, t = time.process_time(), time.perf_counter()
    for job in range(4):  # as the daemon writes 4 durable puts of 64 blocks: transactions of <= 24 values
        for lo in range(0, 64, 24):  # (48 MiB), data synced at each commit, one sync at the end of a job
            txn = env.begin(write=True)
            for j in range(lo, min(64, lo + 24)):
                txn.put(b"%d-%d-%d" % (r, job, j), vals[j % 24])
            committing.set()
            txn.commit()
            committing.clear()
        env.sync(True)
    if r:
        out.append(256 * (2 << 20) / (time.perf_counter() - t) / 1e9)
        cpu.append((time.process_time() - c) / (256 * (2 << 20)) * 1e9)
    with env.begin(write=True) as txn:
        for job in range(4):
            for j in range(64):
                txn.delete(b"%d-%d-%d" % (r, job, j))
    env.sync(True)
print(" ".join(map(str, out)))
print(" ".join(map(str, cpu)))
"""


def lmdb_ref(tmp: Path, reps: int) -> dict:
    """LMDB alone: the daemon's durable write pattern (transactions of up to 24 x 2 MiB, data synced at
    each commit with writeback started during the commit's copy, one sync per 64-block put, metasync
    off) of incompressible 2 MiB values into a
    preallocated file, with the daemon's allocator tunables: the ceiling of any LMDB-backed tier on this
    disk. Also its CPU seconds per GB written (the writer's share of the cores)."""
    from tierkv.daemon.malloc import TUNABLES

    d = tmp / "lmdb-ref"
    d.mkdir()
    env = dict(os.environ, GLIBC_TUNABLES=TUNABLES)
    out = subprocess.run([sys.executable, "-c", _LMDB_REF, str(d), str(reps)], env=env, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    shutil.rmtree(d, ignore_errors=True)
    return {"write": best_median([float(x) for x in out[0].split()]),
            "cpu_s_per_gb": statistics.median(float(x) for x in out[1].split())}


def encoder_ref(blocks: torch.Tensor, codecs: list[str]) -> dict:
    """The disk writer's encoder and the loader's decoder alone: ``encode_block`` / ``decode_block`` of the
    256 blocks on 1 thread and on as many threads as the daemon's pools (``disk.workers``), in logical
    GB/s, with their CPU seconds per GB. The pools share the machine's cores with the LMDB writer, the
    reads and the client."""
    from concurrent.futures import ThreadPoolExecutor

    from tierkv.codecs import decode_block, encode_block
    from tierkv.daemon.config import DiskConfig

    workers = DiskConfig().workers
    fp, u8 = b"\0" * 16, blocks.view(torch.uint8).reshape(N, -1).numpy()
    dst = np.zeros_like(u8)
    out = {}
    for codec in codecs:
        blobs = [encode_block(u8[i], layout=LLAMA, fingerprint=fp, key=b"k%d" % i, codec=codec) for i in range(N)]
        jobs = {"encoder": lambda i, c=codec: encode_block(u8[i], layout=LLAMA, fingerprint=fp, key=b"k%d" % i,
                                                           codec=c),
                "decoder": lambda i, b=blobs: decode_block(b[i], layout=LLAMA, fingerprint=fp, key=b"k%d" % i,
                                                           out=dst[i])}
        for what, job in jobs.items():
            for threads in sorted({1, workers}):
                rates, cpu = [], []
                with ThreadPoolExecutor(threads) as pool:
                    for _ in range(3):
                        c0, t = time.process_time(), time.perf_counter()
                        list(pool.map(job, range(N)))
                        rates.append(u8.nbytes / (time.perf_counter() - t) / GB)
                        cpu.append((time.process_time() - c0) / (u8.nbytes / GB))
                out[f"{what} alone, {codec}, {threads} thread{'s' if threads > 1 else ''}"] = dict(
                    best_median(rates), cpu_s_per_gb=min(cpu))
        assert np.array_equal(dst, u8)
    return out


def resident_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache (mincore on a fresh read-only mapping, which faults nothing)."""
    import ctypes
    import mmap

    size = path.stat().st_size
    if not size:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = np.zeros(pages, np.uint8)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        view = np.frombuffer(m, np.uint8)
        rc = libc.mincore(view.ctypes.data, size, vec.ctypes.data)
        del view
    if rc != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return int((vec & 1).sum()) * mmap.PAGESIZE


@dataclass
class _DiskRun:
    """One codec's disk-tier run: its data dir, socket, daemon arguments and dd scratch files."""

    tmp: Path
    codec: str
    blocks: torch.Tensor

    def __post_init__(self) -> None:
        self.data = self.tmp / f"disk-{self.codec}"
        self.sock = str(self.tmp / f"d-{self.codec}.sock")
        self.mdb = self.data / "disk" / "data.mdb"
        self.args = ["--host-capacity", "1280MiB", "--disk-capacity", "8GiB", "--codec", self.codec]
        self.ddf = self.tmp / f"dd-{self.codec}.bin"
        self.ddkv = self.tmp / f"dd-kv-{self.codec}.bin"  # dd of the same KV bytes (written from /dev/shm)
        self.shm = Path("/dev/shm") / f"tierkv-bench-kv-{os.getpid()}.bin"
        self.shm.write_bytes(self.blocks.view(torch.uint8).numpy().tobytes())
        self.out = torch.zeros_like(self.blocks)  # touched once: reads do not time page faults of fresh memory
        self.m: dict[str, list] = defaultdict(list)

    def daemon(self) -> Daemon:
        return Daemon(self.data, self.sock, self.args).start()

    def rate(self, t: float) -> float:
        return self.blocks.numel() * 2 / (time.perf_counter() - t) / GB

    def put_all(self, c: tierkv.Client, keys: list[bytes]) -> float:
        """Logical GB/s of durable puts of every block, 64 a put."""
        t = time.perf_counter()
        for i in range(0, N, 64):  # durable: returns once encoded, written and fsynced
            c.put(keys[i:i + 64], self.blocks[i:i + 64], durable=True)
        return self.rate(t)

    def read_all(self, keys: list[bytes]) -> float:
        """Logical GB/s of reading every block back from the disk tier, 64 a get."""
        with tierkv.Client.connect(self.sock, model="bench", layout=LLAMA) as c:
            assert c.lookup_tiers(keys) == ["disk"] * N
            self.out.zero_()
            t = time.perf_counter()
            for i in range(0, N, 64):
                c.get(keys[i:i + 64], out=self.out[i:i + 64])
            rate = self.rate(t)
            assert torch.equal(self.out.view(torch.int16), self.blocks.view(torch.int16))
            return rate

    def close(self) -> None:
        for f in (self.ddf, self.ddkv, self.shm):
            f.unlink(missing_ok=True)


def _write_round(r: _DiskRun, rng: np.random.Generator) -> tuple[list[bytes], bytes, int]:
    """First fill, then steady durable writes between two dd writes; leaves the keys on disk only.
    Returns the keys, the namespace fingerprint and the stored bytes."""
    d = r.daemon()
    with tierkv.Client.connect(r.sock, model="bench", layout=LLAMA) as c:
        # First fill: LMDB extends into fresh (preallocated, never written) file extents.
        fill = c.block_keys(rng.integers(0, 50000, N * 16))
        r.m["fill"].append(r.put_all(c, fill))
        c.delete(fill)  # a full cache evicts: the next writes reuse these pages (steady state)
        keys = c.block_keys(rng.integers(0, 50000, N * 16))
        # The references just before and just after (the disk's speed drifts), each run after a pause
        # so that none inherits the virtual disk's flush of the run before it; the tier is compared
        # with the mean of the two.
        before = [_settled(dd, r.ddf, "write"), _settled(dd, r.ddkv, "write", r.shm)]
        _settle()
        r.m["write"].append(r.put_all(c, keys))
        r.m["dd_write"].append((before[0] + _settled(dd, r.ddf, "write")) / 2)
        r.m["dd_write_kv"].append((before[1] + _settled(dd, r.ddkv, "write", r.shm)) / 2)
        r.m["ratio"].append(c.stats()["tiers"]["disk"]["compression_ratio"])
        c.delete(keys)  # leave nothing in host: the next daemon reads only from disk
        c.put(keys, r.blocks, durable=True)
        stored = c.stats()["tiers"]["disk"]["bytes_stored"]
        fp = c.fingerprint
    d.stop()
    return keys, fp, stored


def _read_round(r: _DiskRun, keys: list[bytes], fp: bytes) -> dict:
    """Warm and cold reads by restarted daemons, dd reads beside the cold one, and the same device reads
    without the tier; the keys are deleted at the end. Returns what the page cache held before each."""
    d = r.daemon()  # the page cache holds what the writes left: a warm read
    before_warm = resident_bytes(r.mdb)
    r.m["warm"].append(r.read_all(keys))
    d.stop()
    _drop_cache(r.mdb)  # no process maps the file now: every cached page of it goes
    d = r.daemon()  # its start-up scan reads the headers of every value
    after_scan = resident_bytes(r.mdb)
    _drop_cache(r.mdb)  # again: pages the scan only read (not those the daemon maps) go too
    before_cold = resident_bytes(r.mdb)
    before = [_settled(dd, r.ddf, "read"), _settled(dd, r.ddkv, "read")]  # the references, before and after
    _settle()
    r.m["cold"].append(r.read_all(keys))
    r.m["dd_read"].append((before[0] + _settled(dd, r.ddf, "read")) / 2)
    r.m["dd_read_kv"].append((before[1] + _settled(dd, r.ddkv, "read")) / 2)
    d.stop()
    # The same device reads without the tier, right after: each value with one O_DIRECT read, as many
    # in flight as the daemon's loads, 64 values a batch; no decode, no client.
    r.m["direct"].append(value_reads(r.mdb, [fp + k for k in keys], LOAD_THREADS))
    d = r.daemon()
    with tierkv.Client.connect(r.sock, model="bench", layout=LLAMA) as c:
        c.delete(keys)
    d.stop()
    return {"before_warm": before_warm, "after_scan": after_scan, "before_cold": before_cold}


def disk_bench(tmp: Path, blocks: torch.Tensor, reps: int, codec: str) -> dict:
    """Durable writes, then reads by a restarted daemon: warm (the page cache still holds what the writes
    left there) and cold (the file's pages dropped before and after the daemon's start-up scan). The
    share of the stored bytes in the page cache is measured (mincore) before each read."""
    r = _DiskRun(tmp, codec, blocks)
    rng = np.random.default_rng(2)
    residency = []
    try:
        for _ in range(reps):
            keys, fp, stored = _write_round(r, rng)
            residency.append({"stored": stored, **_read_round(r, keys, fp)})
    finally:
        r.close()
    return _disk_summary(codec, r.m, residency)


def _disk_summary(codec: str, m: dict[str, list], residency: list[dict]) -> dict:
    """The disk rows of one codec from the measurements of every round."""
    mib, stored = 2 ** 20, residency[-1]["stored"]

    def vs(tier: str, ref: str) -> float:
        return statistics.median(a / b for a, b in zip(m[tier], m[ref]))

    return {"codec": codec, "ratio": m["ratio"][-1], "write": best_median(m["write"]),
            "first_fill": best_median(m["fill"]), "dd_write": best_median(m["dd_write"]),
            "dd_read": best_median(m["dd_read"]), "value_reads": best_median(m["direct"]),
            "write_vs_dd": vs("write", "dd_write"), "read_cold_vs_dd": vs("cold", "dd_read"),
            "dd_write_kv": best_median(m["dd_write_kv"]), "dd_read_kv": best_median(m["dd_read_kv"]),
            "write_vs_dd_kv": vs("write", "dd_write_kv"), "read_cold_vs_dd_kv": vs("cold", "dd_read_kv"),
            "read_cold": best_median(m["cold"]), "read_warm": best_median(m["warm"]), "residency": residency,
            "cold_source": "{:.1f} of {:.0f} MiB stored in the page cache before the read (after the start-up scan: "
                           "{:.1f})".format(max(x["before_cold"] for x in residency) / mib, stored / mib,
                                            max(x["after_scan"] for x in residency) / mib),
            "warm_source": "{:.0f} of {:.0f} MiB in the page cache before the read".format(
                min(x["before_warm"] for x in residency) / mib, stored / mib)}


def value_reads(mdb: Path, fks: list[bytes], threads: int) -> float:
    """Logical GB/s of reading the values of ``fks`` from the device as the daemon's loads do (one
    O_DIRECT read of each value's pages, ``threads`` in flight, 64 values a batch), with no tierkv code on
    the path: the values are found with the disk tier's page map on the closed file."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    from tierkv.tiers.disk.pagemap import META, PAGE, PAGE_HDR, PageMap

    with open(mdb, "rb") as f:
        head = f.read(2 * PAGE)
    txnid = max(META.unpack_from(head, pg * PAGE + PAGE_HDR.size)[-1] for pg in (0, 1))
    view, items = PageMap(mdb).walk(txnid)
    where = {k: (off, size) for k, off, size in items}
    spans = []
    for fk in fks:
        off, size = where[fk]
        start = off & ~(PAGE - 1)
        spans.append((start, (off + size - start + PAGE - 1) & ~(PAGE - 1)))
    del view, items
    _drop_cache(mdb)
    fd = os.open(mdb, os.O_RDONLY | os.O_DIRECT)
    bufs = [mmap.mmap(-1, max(n for _, n in spans)) for _ in range(threads)]
    free = list(range(threads))
    lock = threading.Lock()

    def read(span: tuple[int, int]) -> None:
        with lock:
            i = free.pop()
        try:
            os.preadv(fd, [memoryview(bufs[i])[:span[1]]], span[0])
        finally:
            with lock:
                free.append(i)

    try:
        with ThreadPoolExecutor(threads) as pool:
            t = time.perf_counter()
            for i in range(0, len(spans), 64):
                list(pool.map(read, spans[i:i + 64]))
            return len(fks) * LLAMA.block_bytes / (time.perf_counter() - t) / GB
    finally:
        os.close(fd)


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)

#!/usr/bin/env python3
"""Host and disk tier throughput and lookup latency, each beside its reference measured in the same run.

(a) numpy memcpy bandwidth (one 512 MiB copy, and the same bytes as 2 MiB copies);
(b) host-tier put/get through the client, 256 blocks of a Llama-3-8B layout (32 layers, 8 kv heads,
    head dim 128, 16 tokens, bf16: 2 MiB a block);
(c) dd oflag=direct / iflag=direct sequential write/read of the data dir's disk, once up front and
    just before and just after each disk-tier write and cold read, each run after a pause of SETTLE_S
    (the virtual disk's speed drifts by 2x within minutes, so the targets are judged against the mean of
    the two dd runs beside each tier run); LMDB alone with the daemon's write pattern; the
    encoder and the decoder alone on 1 thread and on the pools' threads; and from their CPU costs the CPU
    ceiling of a durable write on this machine's cores;
(d) disk-tier write (durable puts: encoded, written, fsynced) and read by a restarted daemon, warm (the
    page cache holds what the writes left) and cold (the file's pages dropped before and after the
    start-up scan; mincore says how much of it was cached before each read), in logical bytes through
    the client;
(e) lookup latency p50/p99 for 64-key batches with 1 and 8 concurrent client processes, back-to-back and
    paced, beside two references in the same client processes, alternating phase by phase: a bare echo
    server (the transport) and the same LOOKUP written as plainly as Python allows (msgpack both ways, a
    64-key dict walk; thread per connection like the daemon).

Usage: python tools/bench_tiers.py [--reps 5] [--json bench-results/bench_tiers.json] [--only host,disk,lookup]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _benchd import Daemon  # noqa: E402  (tools/ is the script's directory)

import tierkv  # noqa: E402
from tierkv.movers.transfer import LOAD_THREADS  # noqa: E402

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
    from tierkv.daemon.allocator import TUNABLES

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


def disk_bench(tmp: Path, blocks: torch.Tensor, reps: int, codec: str) -> dict:
    """Durable writes, then reads by a restarted daemon: warm (the page cache still holds what the writes
    left there) and cold (the file's pages dropped before and after the daemon's start-up scan). The
    share of the stored bytes in the page cache is measured (mincore) before each read."""
    data = tmp / f"disk-{codec}"
    sock = str(tmp / f"d-{codec}.sock")
    mdb = data / "disk" / "data.mdb"
    args = ["--host-capacity", "1280MiB", "--disk-capacity", "8GiB", "--codec", codec]
    writes, fills, cold, warm, residency, dd_write, dd_read, direct = [], [], [], [], [], [], [], []
    dd_write_kv, dd_read_kv = [], []
    ddf = tmp / f"dd-{codec}.bin"
    ddkv = tmp / f"dd-kv-{codec}.bin"  # dd of the same KV bytes (written from /dev/shm)
    shm = Path("/dev/shm") / f"tierkv-bench-kv-{os.getpid()}.bin"
    shm.write_bytes(blocks.view(torch.uint8).numpy().tobytes())
    ratio = None
    rng = np.random.default_rng(2)
    out = torch.zeros_like(blocks)  # touched once: the reads below do not time page faults of fresh memory

    def read_all(keys: list[bytes]) -> float:
        with tierkv.Client.connect(sock, model="bench", layout=LLAMA) as c:
            assert c.lookup_tiers(keys) == ["disk"] * N
            out.zero_()
            t = time.perf_counter()
            for i in range(0, N, 64):
                c.get(keys[i:i + 64], out=out[i:i + 64])
            rate = blocks.numel() * 2 / (time.perf_counter() - t) / GB
            assert torch.equal(out.view(torch.int16), blocks.view(torch.int16))
            return rate

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
            # The references just before and just after (the disk's speed drifts), each run after a pause
            # so that none inherits the virtual disk's flush of the run before it; the tier is compared
            # with the mean of the two.
            before = [_settled(dd, ddf, "write"), _settled(dd, ddkv, "write", shm)]
            _settle()
            t = time.perf_counter()
            for i in range(0, N, 64):  # durable: returns once encoded, written and fsynced
                c.put(keys[i:i + 64], blocks[i:i + 64], durable=True)
            writes.append(blocks.numel() * 2 / (time.perf_counter() - t) / GB)
            dd_write.append((before[0] + _settled(dd, ddf, "write")) / 2)
            dd_write_kv.append((before[1] + _settled(dd, ddkv, "write", shm)) / 2)
            ratio = c.stats()["tiers"]["disk"]["compression_ratio"]
            c.delete(keys)  # leave nothing in host: the next daemon reads only from disk
            c.put(keys, blocks, durable=True)
            stored = c.stats()["tiers"]["disk"]["bytes_stored"]
            fp = c.fingerprint
        d.stop()
        d = Daemon(data, sock, args).start()  # the page cache holds what the writes left: a warm read
        before_warm = resident_bytes(mdb)
        warm.append(read_all(keys))
        d.stop()
        _drop_cache(mdb)  # no process maps the file now: every cached page of it goes
        d = Daemon(data, sock, args).start()  # its start-up scan reads the headers of every value
        after_scan = resident_bytes(mdb)
        _drop_cache(mdb)  # again: pages the scan only read (not those the daemon maps) go too
        before_cold = resident_bytes(mdb)
        before = [_settled(dd, ddf, "read"), _settled(dd, ddkv, "read")]  # the references, before and after
        _settle()
        cold.append(read_all(keys))
        dd_read.append((before[0] + _settled(dd, ddf, "read")) / 2)
        dd_read_kv.append((before[1] + _settled(dd, ddkv, "read")) / 2)
        d.stop()
        # The same device reads without the tier, right after: each value with one O_DIRECT read, as many
        # in flight as the daemon's loads, 64 values a batch; no decode, no client.
        direct.append(value_reads(mdb, [fp + k for k in keys], LOAD_THREADS))
        d = Daemon(data, sock, args).start()
        with tierkv.Client.connect(sock, model="bench", layout=LLAMA) as c:
            c.delete(keys)
        d.stop()
        residency.append({"stored": stored, "before_warm": before_warm, "after_scan": after_scan,
                          "before_cold": before_cold})
    ddf.unlink()
    ddkv.unlink()
    shm.unlink()
    mib = 2 ** 20
    return {"codec": codec, "ratio": ratio, "write": best_median(writes), "first_fill": best_median(fills),
            "dd_write": best_median(dd_write), "dd_read": best_median(dd_read), "value_reads": best_median(direct),
            "write_vs_dd": statistics.median(w / r for w, r in zip(writes, dd_write)),
            "read_cold_vs_dd": statistics.median(c / r for c, r in zip(cold, dd_read)),
            "dd_write_kv": best_median(dd_write_kv), "dd_read_kv": best_median(dd_read_kv),
            "write_vs_dd_kv": statistics.median(w / r for w, r in zip(writes, dd_write_kv)),
            "read_cold_vs_dd_kv": statistics.median(c / r for c, r in zip(cold, dd_read_kv)),
            "read_cold": best_median(cold), "read_warm": best_median(warm), "residency": residency,
            "cold_source": "{:.1f} of {:.0f} MiB stored in the page cache before the read (after the start-up scan: "
                           "{:.1f})".format(max(r["before_cold"] for r in residency) / mib, stored / mib,
                                            max(r["after_scan"] for r in residency) / mib),
            "warm_source": "{:.0f} of {:.0f} MiB in the page cache before the read".format(
                min(r["before_warm"] for r in residency) / mib, stored / mib)}


def value_reads(mdb: Path, fks: list[bytes], threads: int) -> float:
    """Logical GB/s of reading the values of ``fks`` from the device as the daemon's loads do (one
    O_DIRECT read of each value's pages, ``threads`` in flight, 64 values a batch), with no tierkv code on
    the path: the values are found with the disk tier's page map on the closed file."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    from tierkv.tiers.disk.pages import META, PAGE, PAGE_HDR, PageMap

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


LOOKUP_CONTENDERS = ("echo", "python", "socket", "tierkv")


def _lookup_worker(tk_sock: str, ref_socks: dict[str, str], keys: list[bytes], n: int, rate: float, phases: int,
                   barrier, q) -> None:
    """Time ``n`` lookups against each contender, round-robin in ``phases`` phases that every client
    process starts together (a barrier), so all see the same load from the rest of the machine. ``rate``
    0: back-to-back (closed loop); else each client is paced at ``rate`` lookups/s with exponential gaps,
    like an engine's scheduler.

    - ``echo``: the bare transport: the same request frame (a LOOKUP of these keys, packed once) sent with
      one ``sendall`` to the echo server, its fixed small reply read with ``recv``;
    - ``python``: the same work written as plainly as Python allows, no tierkv code on either side: the
      client packs the request with msgpack and unpacks the reply, the server unpacks it, checks the
      keys and walks a dict of the 64 (fingerprint + key) entries;
    - ``socket``: ``Client.lookup`` answered by the daemon through the socket (``lookup_index=False``);
    - ``tierkv``: ``Client.lookup`` as users get it: from the daemon's shared lookup index."""
    import socket as _socket

    import msgpack

    from tierkv.core import protocol

    socks = {}
    for name, path in ref_socks.items():
        socks[name] = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        socks[name].connect(path)
    frame = protocol.pack(protocol.Op.LOOKUP, 1, {"keys": keys})

    def roundtrip(s, request: bytes) -> bytes:
        s.sendall(request)
        buf = s.recv(4096)
        while len(buf) < protocol.HEADER_BYTES or len(buf) < protocol.HEADER_BYTES + int.from_bytes(buf[12:16], "little"):
            more = s.recv(4096)
            if not more:
                raise ConnectionError("reference server closed")
            buf += more
        return buf

    def echo() -> int:
        roundtrip(socks["echo"], frame)
        return len(keys)

    def python() -> int:
        payload = msgpack.packb({"keys": keys}, use_bin_type=True)
        reply = roundtrip(socks["python"], protocol.HEADER.pack(b"TK", 1, 0, 6, 0, 1, len(payload)) + payload)
        return msgpack.unpackb(reply[protocol.HEADER_BYTES:])["count"]

    c = tierkv.Client.connect(tk_sock, model="bench", layout=LLAMA, populate=False)
    cs = tierkv.Client.connect(tk_sock, model="bench", layout=LLAMA, populate=False, lookup_index=False)
    assert c._index is not None, "the daemon passed no lookup index (tierkv._lookup not built?)"
    calls = {"echo": echo, "python": python, "socket": lambda: cs.lookup(keys), "tierkv": lambda: c.lookup(keys)}
    lats: dict[str, list[float]] = {name: [] for name in LOOKUP_CONTENDERS}
    rng = np.random.default_rng(os.getpid())
    try:
        for _ in range(50):
            for call in calls.values():
                call()
        for phase in range(phases):
            name = LOOKUP_CONTENDERS[phase % len(LOOKUP_CONTENDERS)]
            call, lat = calls[name], lats[name]
            barrier.wait(120)
            nxt = time.perf_counter()
            for _ in range(n * len(LOOKUP_CONTENDERS) // phases):
                if rate:
                    nxt += rng.exponential(1.0 / rate)
                    delay = nxt - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                t = time.perf_counter()
                got = call()
                lat.append(time.perf_counter() - t)
                assert got == len(keys)
    finally:
        c.close()
        cs.close()
        for s in socks.values():
            s.close()
    q.put(lats)


def _ref_serve(conn, table: dict | None) -> None:
    """One connection of a reference server: read frames; ``table`` None: answer a fixed reply (echo);
    else unpack the body, check the keys and count the leading ones in ``table`` (the plain-Python LOOKUP)."""
    import msgpack

    from tierkv.core import protocol

    fixed = protocol.pack(protocol.Op.LOOKUP, 1, {"count": 64})
    fp = b"\1" * 16
    buf = bytearray()
    with conn:
        while True:
            while len(buf) < protocol.HEADER_BYTES:
                chunk = conn.recv(1 << 16)
                if not chunk:
                    return
                buf += chunk
            end = protocol.HEADER_BYTES + int.from_bytes(buf[12:16], "little")
            while len(buf) < end:
                chunk = conn.recv(1 << 16)
                if not chunk:
                    return
                buf += chunk
            if table is None:
                reply = fixed
            else:
                keys = msgpack.unpackb(bytes(buf[protocol.HEADER_BYTES:end]))["keys"]
                n = 0
                for k in keys:
                    if type(k) is not bytes or not 0 < len(k) <= 128:
                        raise ValueError("bad key")
                    if table.get(fp + k) is None:
                        break
                    n += 1
                body = msgpack.packb({"count": n})
                reply = protocol.HEADER.pack(b"TK", 1, 0, 6, 0, 1, len(body)) + body
            del buf[:end]
            conn.sendall(reply)


def _ref_server(path: str, keys: list[bytes] | None, ready) -> None:
    """A reference server: minimal Python, thread per connection, Unix socket (see :func:`_ref_serve`)."""
    import socket as _socket
    import threading

    table = None if keys is None else {b"\1" * 16 + k: object() for k in keys}
    lst = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    lst.bind(path)
    lst.listen(128)
    ready.set()
    while True:
        conn, _ = lst.accept()
        threading.Thread(target=_ref_serve, args=(conn, table), daemon=True).start()


LOOKUP_MODES = ((1, 0), (8, 0), (1, 500), (8, 500))


def _percentiles(lat: list[float]) -> dict:
    lat = sorted(lat)
    return {"p50_us": lat[len(lat) // 2] * 1e6, "p99_us": lat[int(len(lat) * 0.99)] * 1e6, "samples": len(lat)}


def lookup_bench(tmp: Path, blocks: torch.Tensor, n: int = 2000, phases: int = 12) -> dict:
    """tierkv's LOOKUP of 64 cached keys beside the two reference servers, in the same client processes,
    round-robin phase by phase (see :func:`_lookup_worker`)."""
    d = Daemon(tmp / "lk-data", str(tmp / "l.sock"), ["--host-capacity", "256MiB", "--no-disk"]).start()
    ctx = mp.get_context("spawn")
    refs: dict[str, str] = {}
    procs = []
    try:
        with tierkv.Client.connect(d.sock, model="bench", layout=LLAMA) as c:
            keys = c.block_keys(np.arange(64 * 16))
            c.put(keys, blocks[:64])  # every lookup walks 64 cached blocks
        for name in ("echo", "python"):
            ready = ctx.Event()
            refs[name] = str(tmp / f"{name}.sock")
            procs.append(ctx.Process(target=_ref_server, args=(refs[name], keys if name == "python" else None, ready),
                                     daemon=True))
            procs[-1].start()
            assert ready.wait(60), f"{name} server did not start"
        res = {}
        for nclients, rate in LOOKUP_MODES:
            name = f"{nclients} client{'s' if nclients > 1 else ''}, " + (f"paced {rate}/s each" if rate else "back-to-back")
            q, barrier = ctx.Queue(), ctx.Barrier(nclients)
            ps = [ctx.Process(target=_lookup_worker, args=(d.sock, refs, keys, n, rate, phases, barrier, q))
                  for _ in range(nclients)]
            for p in ps:
                p.start()
            got = [q.get(timeout=600) for _ in ps]
            for p in ps:
                p.join()
            res[name] = _percentiles([x for g in got for x in g["tierkv"]])
            for ref in ("echo", "python", "socket"):
                res[name][ref] = _percentiles([x for g in got for x in g[ref]])
                res[name][f"p99_vs_{ref}"] = res[name]["p99_us"] / res[name][ref]["p99_us"]
        return res
    finally:
        for p in procs:
            p.terminate()
            p.join(10)
        d.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="bench-results/bench_tiers.json")
    ap.add_argument("--dir", default=None, help="where the data dirs go (default: a temp dir under ./.tierkv)")
    ap.add_argument("--codecs", default="lossless,raw")
    ap.add_argument("--only", default="host,disk,lookup",
                    help="comma-separated parts to run: host (a, b), disk (c, d), lookup (e)")
    args = ap.parse_args()
    parts = set(args.only.split(","))
    torch.set_num_threads(1)
    base = Path(args.dir or ".tierkv")
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = Path(tempfile.mkdtemp(prefix="bench-", dir=base))
    os.chmod(tmp, 0o700)
    try:
        blocks = kv_blocks(N)
        res: dict = {"blocks": N, "block_bytes": LLAMA.block_bytes, "data": kv_blocks.source}  # type: ignore
        print(f"data: {N} x {LLAMA.block_bytes >> 20} MiB blocks, {res['data']}", flush=True)
        if "host" in parts:
            res["memcpy"] = memcpy_ref(args.reps)
            print("memcpy done", flush=True)
            res["host"] = host_bench(tmp, blocks, args.reps)
            print("host done", flush=True)
        if "disk" in parts:
            res["dd"] = dd_ref(tmp, args.reps)
            res["lmdb"] = lmdb_ref(tmp, args.reps)
            res["encoder"] = encoder_ref(blocks, args.codecs.split(","))
            print("dd, lmdb and encoder references done", flush=True)
            res["disk"] = [disk_bench(tmp, blocks, max(2, args.reps // 2), c) for c in args.codecs.split(",")]
            res["cores"] = os.cpu_count()
            for d in res["disk"]:
                # CPU seconds one logical GB costs the daemon: encoding it, then LMDB writing what it became.
                enc = res["encoder"][f"encoder alone, {d['codec']}, 1 thread"]["cpu_s_per_gb"]
                d["cpu_ceiling"] = res["cores"] / (enc + res["lmdb"]["cpu_s_per_gb"] / d["ratio"])
            print("disk done", flush=True)
        if "lookup" in parts:
            res["lookup"] = lookup_bench(tmp, blocks)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(res)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.json}")


def report(r: dict) -> None:
    rows = []
    if "memcpy" in r:
        mc = r["memcpy"]["bulk"]["best"]
        rows += [("memcpy 512 MiB (reference)", r["memcpy"]["bulk"], mc, None),
                 ("memcpy in 2 MiB pieces", r["memcpy"]["pieces_2mib"], mc, None),
                 ("host put (client, 256 x 2 MiB)", r["host"]["put"], mc, 0.8),
                 ("host get (client, 256 x 2 MiB)", r["host"]["get"], mc, 0.8)]
    if "dd" in r:
        ddw, ddr = r["dd"]["write"]["best"], r["dd"]["read"]["best"]
        rows += [("dd oflag=direct write (reference)", r["dd"]["write"], ddw, None),
                 ("dd iflag=direct read (reference)", r["dd"]["read"], ddr, None),
                 ("LMDB alone: durable put+commit, raw 2 MiB", r["lmdb"]["write"], ddw, None)]
        for name, m in r.get("encoder", {}).items():
            rows.append((name, m, ddr if name.startswith("decoder") else ddw, None))
        for d in r["disk"]:
            rows.append((f"CPU ceiling, {d['codec']}: encode + LMDB on {r['cores']} cores",
                         {"best": d["cpu_ceiling"], "median": d["cpu_ceiling"]}, ddw, None))
        for d in r["disk"]:
            rows += [(f"disk write durable, first fill, {d['codec']}", d["first_fill"], ddw, None),
                     (f"  dd write beside each steady write (mean of before and after), {d['codec']}", d["dd_write"], ddw, None),
                     (f"disk write durable, steady, {d['codec']} ({d['ratio']:.2f}x)", d["write"],
                      d["write"]["best"] / d["write_vs_dd"], 1.0),
                     (f"  dd write of the same KV bytes, beside it, {d['codec']}", d["dd_write_kv"], ddw, None),
                     (f"disk write durable, steady, {d['codec']}, vs dd of the KV bytes", d["write"],
                      d["write"]["best"] / d["write_vs_dd_kv"], 1.0),
                     (f"  dd read beside each cold read (mean of before and after), {d['codec']}", d["dd_read"], ddr, None),
                     (f"  the same reads alone (O_DIRECT, {LOAD_THREADS} in flight), {d['codec']}", d["value_reads"],
                      ddr, None),
                     (f"  dd read of the same KV bytes, beside it, {d['codec']}", d["dd_read_kv"], ddr, None),
                     (f"disk read cold (from the device), {d['codec']}", d["read_cold"],
                      d["read_cold"]["best"] / d["read_cold_vs_dd"], 1.0),
                     (f"disk read cold (from the device), {d['codec']}, vs dd of the KV bytes", d["read_cold"],
                      d["read_cold"]["best"] / d["read_cold_vs_dd_kv"], 1.0),
                     (f"disk read warm (page cache), {d['codec']}", d["read_warm"], ddr, None)]
    if rows:
        print("\nratio: to the reference of the same run; for the targeted disk rows, the median over repetitions of"
              "\n(tier / the dd run beside it)")
        print(f"\n{'measure':56} {'GB/s best':>10} {'median':>8} {'ratio':>7} {'target':>8}")
    for name, m, ref, target in rows:
        ratio = m["best"] / ref
        t = "" if target is None else (f">={target}x " + ("ok" if ratio >= target else "MISS"))
        print(f"{name:56} {m['best']:10.2f} {m['median']:8.2f} {ratio:7.2f} {t:>8}")
    for d in r.get("disk", []):
        print(f"cold reads, {d['codec']}: {d['cold_source']}")
        print(f"warm reads, {d['codec']}: {d['warm_source']}")
    if "lookup" in r:
        print(f"\n{'lookup, 64-key batch (us)':30} {'tierkv p50':>10} {'p99':>7} {'socket p50':>10} {'p99':>7} "
              f"{'echo p50':>9} {'p99':>7} {'python p50':>10} {'p99':>7}   target p50<=200 p99<=1000")
        for k, v in r["lookup"].items():
            ok = "ok" if v["p50_us"] <= 200 and v["p99_us"] <= 1000 else "MISS"
            if ok == "MISS":
                floor = [ref for ref in ("echo", "python") if v[ref]["p50_us"] > 200 or v[ref]["p99_us"] > 1000]
                if floor:
                    ok += f" ({' and '.join(floor)} miss{'es' if len(floor) == 1 else ''} too)"
            print(f"{k:30} {v['p50_us']:10.0f} {v['p99_us']:7.0f} {v['socket']['p50_us']:10.0f} "
                  f"{v['socket']['p99_us']:7.0f} {v['echo']['p50_us']:9.0f} {v['echo']['p99_us']:7.0f} "
                  f"{v['python']['p50_us']:10.0f} {v['python']['p99_us']:7.0f}   {ok}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Remote tier throughput against raw redis-py and against memcpy, all measured in one run.

256 blocks of a Llama-3-8B layout (32 layers, 8 kv heads, head dim 128, 16 tokens, bf16: 2 MiB a block,
512 MiB in all), real KV bytes (tools/bench_tiers.py's kv_blocks()), against a redis-server this script
starts on a free loopback port (or --url). Each pass moves all 256 blocks; the rows are interleaved in
every pass and each row reports its best and median GB/s of raw (logical) bytes.

- references: redis-py pipelined SET / GET of the raw bytes (memoryviews, pure-Python packer, same
  pipeline depth as the tier), GET plus a copy into a destination buffer, the default hiredis packer when
  hiredis is installed; numpy memcpy of the same bytes (the host tier's stand-in);
- the tier: put = encode (container + checksum, the remote mover) + pipelined SET; put of blobs already encoded (a block
  the disk tier encoded); get = pipelined GET + verify + decode into the caller's buffers.

Usage: python tools/bench_remote.py [--reps 3] [--codecs raw,lossless] [--json bench-results/bench_remote.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch
from redis.connection import Encoder, PythonRespSerializer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tiers import kv_blocks  # noqa: E402

import tierkv  # noqa: E402
from tierkv.codecs import encode_block  # noqa: E402
from tierkv.core.keys import Namespace  # noqa: E402
from tierkv.movers.remote import RemoteMover  # noqa: E402
from tierkv.tiers.remote import RemoteTier  # noqa: E402

LLAMA = tierkv.Layout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16, dtype="bfloat16")
N = 256
GB = 1e9


def start_server(tmp: Path) -> tuple[subprocess.Popen, int]:
    exe = shutil.which("redis-server") or shutil.which("valkey-server")
    if not exe:
        sys.exit("redis-server not found (tools/ensure_services.sh installs it), or pass --url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--maxmemory", "4gb", "--maxmemory-policy", "allkeys-lru", "--dir", str(tmp),
                             "--logfile", str(tmp / "redis.log")], stdout=subprocess.DEVNULL, start_new_session=True)
    r = redis.Redis(port=port, protocol=2)
    for _ in range(500):
        try:
            r.ping()
            return proc, port
        except redis.ConnectionError:
            time.sleep(0.02)
    proc.kill()
    sys.exit("redis-server did not start")


def stat(xs: list[float]) -> dict:
    return {"best": max(xs), "median": statistics.median(xs), "all": [round(x, 4) for x in xs]}


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return N * LLAMA.block_bytes / (time.perf_counter() - t) / GB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--codecs", default="raw,lossless")
    ap.add_argument("--blocks", type=int, default=256, help="blocks per pass (256: 512 MiB)")
    ap.add_argument("--batch", type=int, default=16, help="keys per pipelined round trip (tier and references)")
    ap.add_argument("--url", default=None, help="use this server instead of starting one (it is FLUSHALLed!)")
    ap.add_argument("--json", default="bench-results/bench_remote.json")
    args = ap.parse_args()
    global N
    N = args.blocks
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="tkv-bench-redis-", dir="/tmp"))
    proc = None
    try:
        if args.url:
            url = args.url
            admin = redis.Redis.from_url(url, protocol=2)
        else:
            proc, port = start_server(tmp)
            url = f"redis://127.0.0.1:{port}/0"
            admin = redis.Redis(port=port, protocol=2)
        res = run(url, admin, args)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    report(res)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.json}")


class Bench:
    """The data, clients and tier of one run, and each measured operation (one pass over every block)."""

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        bb = LLAMA.block_bytes
        self.url, self.B = url, args.batch
        self.data = kv_blocks(N).view(torch.uint8).numpy().reshape(N, bb)
        self.fp = Namespace("bench", LLAMA).fingerprint
        self.keys = [b"%08d" % i for i in range(N)]
        self.rkeys = [b"raw:%08d" % i for i in range(N)]
        self.views = [memoryview(self.data[i]) for i in range(N)]
        self.dst = np.empty_like(self.data)
        self.dst.fill(0)  # fault the pages in now, not inside a timed pass
        packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
        self.raw_client = redis.Redis.from_url(url, protocol=2, command_packer=packer)
        try:
            import hiredis  # noqa: F401

            self.hiredis_client: redis.Redis | None = redis.Redis.from_url(url, protocol=2)  # hiredis packer
        except ImportError:
            self.hiredis_client = None
        self.tier = RemoteTier(url, max_batch=self.B, socket_timeout_s=10.0)
        self.mover = RemoteMover(self.tier)
        self.codecs = [c for c in args.codecs.split(",") if c]
        self.encoded = {c: [encode_block(self.data[i], layout=LLAMA, fingerprint=self.fp, key=self.keys[i], codec=c)
                            for i in range(N)] for c in self.codecs}

    def redis_set(self, client: redis.Redis) -> None:
        for i in range(0, N, self.B):
            p = client.pipeline(transaction=False)
            for j in range(i, min(N, i + self.B)):
                p.set(self.rkeys[j], self.views[j])
            p.execute()

    def redis_get(self, copy: bool) -> None:
        for i in range(0, N, self.B):
            p = self.raw_client.pipeline(transaction=False)
            for j in range(i, min(N, i + self.B)):
                p.get(self.rkeys[j])
            vals = p.execute()
            if copy:
                for j, v in zip(range(i, min(N, i + self.B)), vals):
                    np.copyto(self.dst[j], np.frombuffer(v, np.uint8))

    def memcpy_pieces(self) -> None:
        for i in range(N):
            np.copyto(self.dst[i], self.data[i])

    def memcpy_all(self) -> None:
        np.copyto(self.dst.reshape(-1), self.data.reshape(-1))

    def tier_store(self, codec: str) -> None:
        ok = self.mover.store([(self.fp, self.keys[i], self.data[i]) for i in range(N)], LLAMA, codec=codec)
        assert all(ok), self.tier.state()

    def tier_put_encoded(self, codec: str) -> None:
        ok = self.tier.put_many([(self.fp, self.keys[i], self.encoded[codec][i]) for i in range(N)])
        assert all(ok), self.tier.state()

    def tier_fetch(self) -> None:
        ok = self.mover.fetch([(self.fp, k) for k in self.keys], LLAMA, list(self.dst))
        assert all(ok), self.tier.stats()

    def tier_get_raw_values(self) -> None:
        vals = self.tier.get_many([(self.fp, k) for k in self.keys])
        assert all(v is not None for v in vals)

    def one_pass(self, add: Callable[..., None], flush: Callable[[], Any]) -> None:
        """Every row once, interleaved."""
        add("memcpy 512 MiB", self.memcpy_all)
        add("memcpy 2 MiB pieces", self.memcpy_pieces)
        add("redis-py SET (python packer)", lambda: self.redis_set(self.raw_client), flush)
        if self.hiredis_client is not None:
            add("redis-py SET (hiredis packer)", lambda: self.redis_set(self.hiredis_client), flush)
            self.redis_set(self.raw_client)
        add("redis-py GET", lambda: self.redis_get(False))
        add("redis-py GET + copy into buffer", lambda: self.redis_get(True))
        for c in self.codecs:
            add(f"tier put, encode {c} + SET", lambda c=c: self.tier_store(c), flush)
            add(f"tier put, pre-encoded {c} blobs", lambda c=c: self.tier_put_encoded(c), flush)
            add(f"tier get, GET + verify + decode {c}", self.tier_fetch)
            if c == self.codecs[0]:
                add(f"tier get_many, unverified {c} values", self.tier_get_raw_values)
            assert np.array_equal(self.dst, self.data), "decoded blocks differ"

    def close(self) -> dict:
        """Stop the tier; its stats."""
        st = self.tier.stats()
        self.mover.close()
        self.tier.close()
        return st


def run(url: str, admin: redis.Redis, args: argparse.Namespace) -> dict:
    bench = Bench(url, args)
    rows: dict[str, list[float]] = {}

    def add(name: str, fn: Callable[[], None], before: Callable[[], Any] | None = None) -> None:
        if before is not None:
            before()
        rows.setdefault(name, []).append(timed(fn))

    for rep in range(args.reps + 1):  # the first pass warms the server's allocator and is not kept
        bench.one_pass(add, admin.flushall)
        if rep == 0:
            rows.clear()
        print(f"pass {rep} done", flush=True)
    st = bench.close()
    info = admin.info("server")
    sizes = {c: sum(len(b) for b in bench.encoded[c]) for c in bench.codecs}
    return {"blocks": N, "block_bytes": LLAMA.block_bytes, "data": kv_blocks.source,  # type: ignore[attr-defined]
            "batch": bench.B, "reps": args.reps, "server": f"{info.get('redis_version')} ({url.split('@')[-1]})",
            "redis_py": redis.__version__, "hiredis": bench.hiredis_client is not None, "codecs": bench.codecs,
            "stored_bytes": sizes, "rows": {k: stat(v) for k, v in rows.items()}, "tier_stats": st,
            "cpus": os.cpu_count()}


def report(r: dict) -> None:
    rows = r["rows"]
    ref_set = rows["redis-py SET (python packer)"]["best"]
    ref_get = rows["redis-py GET"]["best"]
    mc = rows["memcpy 2 MiB pieces"]["best"]
    print(f"\n{r['blocks']} x {r['block_bytes'] >> 20} MiB blocks ({r['data']}), pipeline {r['batch']}, "
          f"server {r['server']}, redis-py {r['redis_py']}, hiredis {'yes' if r['hiredis'] else 'no'}")
    for c, n in r["stored_bytes"].items():
        print(f"  {c}: {r['blocks'] * r['block_bytes'] / n:.2f}x ({n / 2**20:.0f} MiB stored)")
    print(f"\n{'measure (GB/s of raw block bytes)':44} {'best':>7} {'median':>7} {'vs redis-py':>12} "
          f"{'vs memcpy':>10}")
    for name, m in rows.items():
        ref = None
        if name.startswith("tier put") or name.startswith("redis-py SET"):
            ref = ref_set
        elif name.startswith("tier get") or name.startswith("redis-py GET"):
            ref = ref_get
        vs = f"{m['best'] / ref:.2f}" if ref else ""
        print(f"{name:44} {m['best']:7.2f} {m['median']:7.2f} {vs:>12} {m['best'] / mc:10.2f}")


if __name__ == "__main__":
    main()

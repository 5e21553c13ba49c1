#!/usr/bin/env python3
"""Remote tier throughput against raw redis-py and against memcpy, all measured in one run.

256 blocks of a Llama-3-8B layout (32 layers, 8 kv heads, head dim 128, 16 tokens, bf16: 2 MiB a block,
512 MiB in all), real KV bytes (tools/bench_tiers.py's kv_blocks()), against a redis-server this script
starts on a free loopback port (or --url). Each pass moves all 256 blocks; the rows are interleaved in
every pass and each row reports its best and median GB/s of raw (logical) bytes.

- references: redis-py pipelined SET / GET of the raw bytes (memoryviews, pure-Python packer, same
  pipeline depth as the tier), GET plus a copy into a destination buffer, the default hiredis packer when
  hiredis is installed; numpy memcpy of the same bytes (the host tier's stand-in);
- the tier: put = encode (container + checksum) + pipelined SET; put of blobs already encoded (a block
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
from pathlib import Path

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


def run(url: str, admin: redis.Redis, args) -> dict:
    bb = LLAMA.block_bytes
    data = kv_blocks(N).view(torch.uint8).numpy().reshape(N, bb)
    fp = Namespace("bench", LLAMA).fingerprint
    keys = [b"%08d" % i for i in range(N)]
    rkeys = [b"raw:%08d" % i for i in range(N)]
    views = [memoryview(data[i]) for i in range(N)]
    dst = np.empty_like(data)
    dst.fill(0)  # fault the pages in now, not inside a timed pass
    big_src = data.reshape(-1)
    big_dst = dst.reshape(-1)
    B = args.batch
    packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    raw_client = redis.Redis.from_url(url, protocol=2, command_packer=packer)
    try:
        import hiredis  # noqa: F401

        hiredis_client = redis.Redis.from_url(url, protocol=2)  # default packer: hiredis when installed
    except ImportError:
        hiredis_client = None
    tier = RemoteTier(url, max_batch=B, socket_timeout_s=10.0)
    codecs = [c for c in args.codecs.split(",") if c]
    encoded = {c: [encode_block(data[i], layout=LLAMA, fingerprint=fp, key=keys[i], codec=c) for i in range(N)]
               for c in codecs}
    sizes = {c: sum(len(b) for b in encoded[c]) for c in codecs}

    def redis_set(client: redis.Redis) -> None:
        for i in range(0, N, B):
            p = client.pipeline(transaction=False)
            for j in range(i, min(N, i + B)):
                p.set(rkeys[j], views[j])
            p.execute()

    def redis_get(copy: bool) -> None:
        for i in range(0, N, B):
            p = raw_client.pipeline(transaction=False)
            for j in range(i, min(N, i + B)):
                p.get(rkeys[j])
            vals = p.execute()
            if copy:
                for j, v in zip(range(i, min(N, i + B)), vals):
                    np.copyto(dst[j], np.frombuffer(v, np.uint8))

    def memcpy_pieces() -> None:
        for i in range(N):
            np.copyto(dst[i], data[i])

    def tier_store(codec: str) -> None:
        ok = tier.store_blocks([(fp, keys[i], data[i]) for i in range(N)], LLAMA, codec=codec)
        assert all(ok), tier.state()

    def tier_put_encoded(codec: str) -> None:
        ok = tier.put_many([(fp, keys[i], encoded[codec][i]) for i in range(N)])
        assert all(ok), tier.state()

    def tier_fetch() -> None:
        ok = tier.fetch_verified([(fp, k) for k in keys], LLAMA, list(dst))
        assert all(ok), tier.stats()

    def tier_get_raw_values() -> None:
        vals = tier.get_many([(fp, k) for k in keys])
        assert all(v is not None for v in vals)

    rows: dict[str, list[float]] = {}

    def add(name: str, fn, before=None) -> None:
        if before is not None:
            before()
        rows.setdefault(name, []).append(timed(fn))

    flush = admin.flushall
    for rep in range(args.reps + 1):  # the first pass warms the server's allocator and is not kept
        add("memcpy 512 MiB", lambda: np.copyto(big_dst, big_src))
        add("memcpy 2 MiB pieces", memcpy_pieces)
        add("redis-py SET (python packer)", lambda: redis_set(raw_client), flush)
        if hiredis_client is not None:
            add("redis-py SET (hiredis packer)", lambda: redis_set(hiredis_client), flush)
            redis_set(raw_client)
        add("redis-py GET", lambda: redis_get(False))
        add("redis-py GET + copy into buffer", lambda: redis_get(True))
        for c in codecs:
            add(f"tier put, encode {c} + SET", lambda c=c: tier_store(c), flush)
            add(f"tier put, pre-encoded {c} blobs", lambda c=c: tier_put_encoded(c), flush)
            add(f"tier get, GET + verify + decode {c}", tier_fetch)
            if c == codecs[0]:
                add(f"tier get_many, unverified {c} values", tier_get_raw_values)
            assert np.array_equal(dst, data), "decoded blocks differ"
        if rep == 0:
            rows.clear()
        print(f"pass {rep} done", flush=True)
    st = tier.stats()
    tier.close()
    info = admin.info("server")
    return {"blocks": N, "block_bytes": bb, "data": kv_blocks.source,  # type: ignore[attr-defined]
            "batch": B, "reps": args.reps, "server": f"{info.get('redis_version')} ({url.split('@')[-1]})",
            "redis_py": redis.__version__, "hiredis": hiredis_client is not None, "codecs": codecs,
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
          f"{'vs memcpy':>10} {'target':>9}")
    for name, m in rows.items():
        ref = None
        if name.startswith("tier put") or name.startswith("redis-py SET"):
            ref = ref_set
        elif name.startswith("tier get") or name.startswith("redis-py GET"):
            ref = ref_get
        target = ""
        if name.startswith("tier put, encode") or name.startswith("tier get, GET"):
            target = ">=0.8x " + ("ok" if m["best"] / ref >= 0.8 else "MISS")
        vs = f"{m['best'] / ref:.2f}" if ref else ""
        print(f"{name:44} {m['best']:7.2f} {m['median']:7.2f} {vs:>12} {m['best'] / mc:10.2f} {target:>9}")


if __name__ == "__main__":
    main()

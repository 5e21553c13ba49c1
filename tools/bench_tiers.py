#!/usr/bin/env python3
"""Host and disk tier throughput and lookup latency, each beside its reference measured in the same run.

(a) numpy memcpy bandwidth (one 512 MiB copy, and the same bytes as 2 MiB copies);
(b) host-tier put/get through the client, 256 blocks of a Llama-3-8B layout (32 layers, 8 kv heads,
    head dim 128, 16 tokens, bf16: 2 MiB a block);
(c) dd oflag=direct / iflag=direct sequential write/read of the data dir's disk, once up front and
    just before and just after each disk-tier write and cold read, each run after a pause of SETTLE_S
    (the virtual disk's speed drifts by 2x within minutes, so the disk-tier rows are set against the mean
    of the two dd runs beside each tier run); LMDB alone with the daemon's write pattern; the
    encoder and the decoder alone on 1 thread and on the pools' threads; and from their CPU costs the CPU
    ceiling of a durable write on this machine's cores;
(d) disk-tier write (durable puts: encoded, written, fsynced) and read by a restarted daemon, warm (the
    page cache holds what the writes left) and cold (the file's pages dropped before and after the
    start-up scan; mincore says how much of it was cached before each read), in logical bytes through
    the client;
(e) lookup latency p50/p99 for 64-key batches with 1 and 8 concurrent client processes, back-to-back and
    paced, beside two references in the same client processes, alternating phase by phase: a bare echo
    server (the transport) and the same LOOKUP written as plainly as Python allows (msgpack both ways, a
    64-key dict walk; thread per connection like the daemon);
(f) the plain API as a user first calls it: put(keys, t), get(keys), get(keys, out=warm), 256 MiB in
    64 MiB batches, each beside the torch copy of the same bytes (tools/_bench_api.py).

Usage: python tools/bench_tiers.py [--reps 5] [--json bench-results/bench_tiers.json] [--only host,api,disk,lookup]
(--only api: the plain-API rows (f) alone, in about a minute)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _bench_api import api_bench, report_api  # noqa: E402  (tools/ is the script's directory)
from _bench_common import GB, LLAMA, N, best_median, kv_blocks  # noqa: E402
from _bench_disk import dd_ref, disk_bench, encoder_ref, lmdb_ref  # noqa: E402
from _bench_lookup import lookup_bench  # noqa: E402
from _benchd import Daemon  # noqa: E402

import tierkv  # noqa: E402
from tierkv.movers.engine import LOAD_THREADS  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="bench-results/bench_tiers.json")
    ap.add_argument("--dir", default=None, help="where the data dirs go (default: a temp dir under ./.tierkv)")
    ap.add_argument("--codecs", default="lossless,raw")
    ap.add_argument("--only", default="host,api,disk,lookup",
                    help="comma-separated parts to run: host (a, b), api (f), disk (c, d), lookup (e)")
    args = ap.parse_args()
    parts = set(args.only.split(","))
    user_threads = torch.get_num_threads()  # the API rows run as a user's process does
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
        if "api" in parts:
            res["api"] = api_bench(tmp, blocks, args.reps, user_threads)
            print("api done", flush=True)
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
    if "api" in res:
        report_api(res["api"])
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.json}")


def report(r: dict) -> None:
    rows = []
    if "memcpy" in r:
        mc = r["memcpy"]["bulk"]["best"]
        rows += [("memcpy 512 MiB (reference)", r["memcpy"]["bulk"], mc),
                 ("memcpy in 2 MiB pieces", r["memcpy"]["pieces_2mib"], mc),
                 ("host put (client, 256 x 2 MiB)", r["host"]["put"], mc),
                 ("host get (client, 256 x 2 MiB)", r["host"]["get"], mc)]
    if "dd" in r:
        ddw, ddr = r["dd"]["write"]["best"], r["dd"]["read"]["best"]
        rows += [("dd oflag=direct write (reference)", r["dd"]["write"], ddw),
                 ("dd iflag=direct read (reference)", r["dd"]["read"], ddr),
                 ("LMDB alone: durable put+commit, raw 2 MiB", r["lmdb"]["write"], ddw)]
        for name, m in r.get("encoder", {}).items():
            rows.append((name, m, ddr if name.startswith("decoder") else ddw))
        for d in r["disk"]:
            rows.append((f"CPU ceiling, {d['codec']}: encode + LMDB on {r['cores']} cores",
                         {"best": d["cpu_ceiling"], "median": d["cpu_ceiling"]}, ddw))
        for d in r["disk"]:
            rows += [(f"disk write durable, first fill, {d['codec']}", d["first_fill"], ddw),
                     (f"  dd write beside each steady write (mean of before and after), {d['codec']}", d["dd_write"], ddw),
                     (f"disk write durable, steady, {d['codec']} ({d['ratio']:.2f}x)", d["write"],
                      d["write"]["best"] / d["write_vs_dd"]),
                     (f"  dd write of the same KV bytes, beside it, {d['codec']}", d["dd_write_kv"], ddw),
                     (f"disk write durable, steady, {d['codec']}, vs dd of the KV bytes", d["write"],
                      d["write"]["best"] / d["write_vs_dd_kv"]),
                     (f"  dd read beside each cold read (mean of before and after), {d['codec']}", d["dd_read"], ddr),
                     (f"  the same reads alone (O_DIRECT, {LOAD_THREADS} in flight), {d['codec']}", d["value_reads"],
                      ddr),
                     (f"  dd read of the same KV bytes, beside it, {d['codec']}", d["dd_read_kv"], ddr),
                     (f"disk read cold (from the device), {d['codec']}", d["read_cold"],
                      d["read_cold"]["best"] / d["read_cold_vs_dd"]),
                     (f"disk read cold (from the device), {d['codec']}, vs dd of the KV bytes", d["read_cold"],
                      d["read_cold"]["best"] / d["read_cold_vs_dd_kv"]),
                     (f"disk read warm (page cache), {d['codec']}", d["read_warm"], ddr)]
    if rows:
        print("\nratio: to the reference of the same run; for the steady disk writes and the cold disk reads, the"
              "\nmedian over repetitions of (tier / the dd run beside it)")
        print(f"\n{'measure':56} {'GB/s best':>10} {'median':>8} {'ratio':>7}")
    for name, m, ref in rows:
        print(f"{name:56} {m['best']:10.2f} {m['median']:8.2f} {m['best'] / ref:7.2f}")
    for d in r.get("disk", []):
        print(f"cold reads, {d['codec']}: {d['cold_source']}")
        print(f"warm reads, {d['codec']}: {d['warm_source']}")
    if "lookup" in r:
        print(f"\n{'lookup, 64-key batch (us)':30} {'tierkv p50':>10} {'p99':>7} {'socket p50':>10} {'p99':>7} "
              f"{'echo p50':>9} {'p99':>7} {'python p50':>10} {'p99':>7}")
        for k, v in r["lookup"].items():
            print(f"{k:30} {v['p50_us']:10.0f} {v['p99_us']:7.0f} {v['socket']['p50_us']:10.0f} "
                  f"{v['socket']['p99_us']:7.0f} {v['echo']['p50_us']:9.0f} {v['echo']['p99_us']:7.0f} "
                  f"{v['python']['p50_us']:10.0f} {v['python']['p99_us']:7.0f}")


if __name__ == "__main__":
    main()

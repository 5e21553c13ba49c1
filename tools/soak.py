"""Soak: N client processes with an oracle against one daemon for a given time; resource slopes.

Every client runs a random mix of put (some durable), get, lookup, acquire-hold-release, alloc+abort,
delete and reconnect over its own keys and a set shared by all clients. Block bytes derive from the
key, so every get is checked (a mismatch is a wrong block served). The daemon is sampled every
``--sample`` seconds: RSS split into anonymous (the heap, where a leak shows), file-backed (LMDB's map,
which grows with the disk tier until the working set is on disk) and shared (the host pool's memfd,
bounded by its capacity), open fds, mappings, threads (/proc/PID), and leases, clients, LMDB reader
slots and tier usage (``tierkv stats``). After the warm-up the slopes are fitted by least squares and
printed per hour.

    python tools/soak.py                                  # 10 minutes, 16 clients
    python tools/soak.py --duration 90 --clients 8        # a short run
    python tools/soak.py --socket /run/tierkv.sock        # against a running daemon

Warm-up is ``--warmup`` of the run and lasts at least until the disk tier holds its working set (its
block count within 2% of its peak); the slope with the fixed share alone is reported beside it.
Exit status 1 if a get returned a wrong block (a mismatch), leases remained once the clients were
idle, or a tierkv entry appeared in /dev/shm.
Writes bench-results/soak.json. Run the full version on a quiet machine: on a shared one the slopes
carry the neighbours' noise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
MODEL = "soak"
LAYOUT_ARGS = (2, 4, 32, 16, "bfloat16")  # 16 KiB blocks
PRIVATE_KEYS = 600  # per client: with 16 clients ~160 MB of blocks, 2.5x the host tier, all fit on disk
SHARED_KEYS = 500  # used by every client (dedup and contention on the same blocks)


def key_of(tag: str) -> bytes:
    return hashlib.blake2b(tag.encode(), digest_size=16).digest()


def values(keys: list[bytes], layout) -> np.ndarray:
    """The oracle: each block's bytes derive from its key."""
    n = layout.block_bytes // 2
    out = np.empty((len(keys), n), np.uint16)
    for i, k in enumerate(keys):
        out[i] = np.random.default_rng(int.from_bytes(k[:8], "little")).integers(0, 1 << 16, n, np.uint16)
    return out.reshape(layout.batch_shape(len(keys)))


# ---- a client process ------------------------------------------------------------------------------
class SoakClient:
    """One client process: its connection, its keys, its counters and its latency samples."""

    def __init__(self, idx: int, sock: str, seed: int) -> None:
        import tierkv

        self.idx, self.sock = idx, sock
        self.layout = tierkv.Layout(*LAYOUT_ARGS)
        self.rng = random.Random(seed)
        self.mine = [key_of(f"c{idx}/{i}") for i in range(PRIVATE_KEYS)]
        self.shared = [key_of(f"shared/{i}") for i in range(SHARED_KEYS)]
        self.counts = {"ops": 0, "gets": 0, "blocks_checked": 0, "misses": 0, "mismatches": 0, "errors": 0,
                       "reconnects": 0, "full": 0}
        self.lat: list[tuple[float, float]] = []  # (wall time, seconds) of leased gets, for p99 over time
        self.error_samples: list[str] = []
        self.c = self.connect()

    def connect(self):
        import tierkv

        return tierkv.Client.connect(self.sock, model=MODEL, layout=self.layout)

    def pick(self, n: int) -> list[bytes]:
        pool = self.shared if self.rng.random() < 0.3 else self.mine
        start = self.rng.randrange(len(pool) - n)
        return pool[start:start + n]  # runs of neighbours, like prefixes

    def check_views(self, lease, keys: list[bytes]) -> None:
        """Compare the leased blocks with the oracle."""
        import torch

        got = torch.stack(lease.views).view(torch.int16).numpy().view(np.uint16)
        self.counts["blocks_checked"] += lease.count
        if not np.array_equal(got, values(keys[:lease.count], self.layout)):
            self.counts["mismatches"] += 1

    def leased_get(self, n: int) -> None:
        keys = self.pick(n)
        t0 = time.perf_counter()
        with self.c.acquire(keys) as lease:
            if lease.count:
                self.check_views(lease, keys)
            k = lease.count
        self.lat.append((time.time(), time.perf_counter() - t0))
        self.counts["gets"] += 1
        if k < n:
            self.counts["misses"] += 1

    def held_lease(self, n: int) -> None:
        keys = self.pick(n)
        with self.c.acquire(keys) as lease:  # hold it a little while others run
            time.sleep(self.rng.uniform(0, 0.02))
            if lease.count:
                self.check_views(lease, keys)

    def reconnect(self, n: int) -> None:
        self.c.close()  # sometimes politely, sometimes leaving a lease behind for the daemon to free
        self.c = self.connect()
        self.counts["reconnects"] += 1
        if self.rng.random() < 0.5:
            self.c.acquire(self.pick(n))  # never released: freed when the connection goes

    def step(self) -> None:
        """One random operation."""
        from tierkv.core.errors import KeyMissing

        r, n = self.rng.random(), self.rng.randint(1, 8)
        self.counts["ops"] += 1
        if r < 0.25:
            keys = self.pick(n)
            self.c.put(keys, values(keys, self.layout), durable=self.rng.random() < 0.1)
        elif r < 0.60:
            self.leased_get(n)
        elif r < 0.70:
            self.c.lookup(self.pick(n))
        elif r < 0.80:
            self.held_lease(n)
        elif r < 0.86:
            self.c.alloc(n).abort()
        elif r < 0.91:
            try:
                self.c.get(self.pick(n))
            except KeyMissing:
                self.counts["misses"] += 1
        elif r < 0.97:
            self.c.delete(self.pick(self.rng.randint(1, 2)) if self.rng.random() < 0.5 else [self.rng.choice(self.mine)])
        else:
            self.reconnect(n)

    def failed(self, exc) -> None:
        """Count a failed operation; reconnect when the connection went."""
        from tierkv.core.errors import TierKVError

        if exc.code == "full":
            self.counts["full"] += 1
            return
        self.counts["errors"] += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(f"{type(exc).__name__}: {exc}")
        if exc.code == "connection":
            try:
                self.c = self.connect()
            except TierKVError:
                time.sleep(0.5)


def client_main(idx: int, sock: str, ready, stop, seed: int, out: mp.Queue) -> None:
    from tierkv.core.errors import TierKVError

    client = SoakClient(idx, sock, seed)
    ready.release()
    while not stop.is_set():
        try:
            client.step()
        except TierKVError as exc:
            client.failed(exc)
    client.c.close()
    out.put({"client": idx, **client.counts, "lat": client.lat, "error_samples": client.error_samples})


# ---- the daemon and its figures --------------------------------------------------------------------
# RSS = anonymous (heap: where a leak shows) + file (LMDB's map: page cache of the disk tier, grows with
# it) + shmem (the host pool's memfd, bounded by its capacity).
_STATUS = {"VmRSS": "rss_kb", "RssAnon": "anon_kb", "RssFile": "file_kb", "RssShmem": "shmem_kb", "Threads": "threads"}


def proc_sample(pid: int) -> dict[str, int]:
    s = {"fds": len(os.listdir(f"/proc/{pid}/fd")), "maps": sum(1 for _ in open(f"/proc/{pid}/maps"))}
    for line in open(f"/proc/{pid}/status"):
        k, _, v = line.partition(":")
        if k in _STATUS:
            s[_STATUS[k]] = int(v.split()[0])
    return s


def sample(sock: str, pid: int, t0: float) -> dict:
    from tierkv.client.admin import request

    st = request(sock, "STATS")
    disk = st["tiers"].get("disk", {})
    return {"t": round(time.time() - t0, 2), **proc_sample(pid), "leases": st["leases"],
            "clients": st["clients"] - 1, "readers": disk.get("readers", 0),
            "host_used": st["tiers"]["host"]["used_bytes"], "disk_used": disk.get("used_bytes", 0),
            "disk_blocks": disk.get("blocks", 0), "requests": st["requests"],
            "shm": sum(1 for n in os.listdir("/dev/shm") if n.startswith("tierkv"))}


def slope_per_hour(samples: list[dict], key: str) -> float:
    t = np.array([s["t"] for s in samples], float)
    y = np.array([s[key] for s in samples], float)
    if len(t) < 3 or np.ptp(t) == 0:
        return 0.0
    return float(np.polyfit(t, y, 1)[0] * 3600.0)


def start_daemon(work: Path) -> tuple[subprocess.Popen, str]:
    from tierkv.client.admin import request
    from tierkv.core.errors import ConnectionFailed
    from tierkv.daemon.malloc import TUNABLES

    sockdir = work / "run"
    sockdir.mkdir(mode=0o700)
    sock = str(sockdir / "s")
    cmd = [sys.executable, "-m", "tierkv", "serve", "--socket", sock, "--data-dir", str(work / "data"),
           "--host-capacity", "64MiB", "--slab-bytes", "4MiB", "--disk-capacity", "1GiB"]
    logf = open(work / "daemon.log", "ab")
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO,
                            env=dict(os.environ, GLIBC_TUNABLES=TUNABLES, PYTHONUNBUFFERED="1"))
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError((work / "daemon.log").read_text()[-2000:])
        try:
            request(sock, "PING")
            return proc, sock
        except ConnectionFailed:
            time.sleep(0.05)
    raise RuntimeError("daemon did not come up")


def p99(xs: list[float]) -> float:
    return float(np.percentile(xs, 99) * 1e3) if xs else 0.0


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--sample", type=float, default=10.0, help="seconds between samples")
    ap.add_argument("--warmup", type=float, default=0.25, help="share of the run left out of the slopes")
    ap.add_argument("--socket", help="use this running daemon instead of starting one")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", default=str(REPO / "bench-results" / "soak.json"))
    return ap.parse_args()


def show(s: dict) -> None:
    print(f"{s['t']:7.1f} {s['rss_kb'] / 1024:7.1f} {s['anon_kb'] / 1024:6.1f} {s['file_kb'] / 1024:6.1f} "
          f"{s['shmem_kb'] / 1024:6.1f} {s['fds']:4d} {s['maps']:5d} {s['threads']:4d} {s['leases']:6d} "
          f"{s['clients']:7d} {s['readers']:7d} {s['host_used'] / 2**20:7.1f} {s['disk_blocks']:8d}",
          flush=True)


def run_load(sock: str, args: argparse.Namespace) -> tuple[list[dict], list[dict], dict, float]:
    """Run the clients for ``--duration`` seconds, sampling the daemon; returns the samples, the
    clients' results, the idle sample after they left, and the start time."""
    from tierkv.client.admin import request

    pid = int(request(sock, "PING")["pid"])
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    ready, stop = ctx.Semaphore(0), ctx.Event()
    clients = [ctx.Process(target=client_main, args=(i, sock, ready, stop, args.seed * 1000 + i, q), daemon=True)
               for i in range(args.clients)]
    for p in clients:
        p.start()
    for _ in clients:  # the clock starts once every client is connected (imports take a while)
        if not ready.acquire(timeout=300):
            raise RuntimeError("a client did not connect within 300 s")
    t0 = time.time()
    stop_at = t0 + args.duration
    samples = [sample(sock, pid, t0)]
    print(f"{'t':>7} {'rss MB':>7} {'anon':>6} {'file':>6} {'shmem':>6} {'fds':>4} {'maps':>5} {'thr':>4} "
          f"{'leases':>6} {'clients':>7} {'readers':>7} {'host MB':>7} {'disk blk':>8}", flush=True)
    show(samples[0])
    while time.time() < stop_at:
        time.sleep(min(args.sample, max(0.0, stop_at - time.time())))
        samples.append(sample(sock, pid, t0))
        show(samples[-1])
    stop.set()
    results = [q.get(timeout=120) for _ in clients]
    for p in clients:
        p.join(30)
    time.sleep(1.0)  # let the daemon notice the last disconnects
    idle = sample(sock, pid, t0)
    show(idle)
    return samples, results, idle, t0


def slopes(steady: list[dict], fixed: list[dict]) -> dict:
    """Least-squares slopes per hour of the steady samples (RSS also over the fixed warm-up)."""
    out = {
        "slope_rss_mb_per_h": round(slope_per_hour(steady, "rss_kb") / 1024, 2),
        "slope_rss_mb_per_h_fixed_warmup": round(slope_per_hour(fixed, "rss_kb") / 1024, 2),
    }
    for key in ("anon", "file", "shmem"):
        out[f"slope_{key}_mb_per_h"] = round(slope_per_hour(steady, f"{key}_kb") / 1024, 2)
    out["slope_disk_blocks_per_h"] = round(slope_per_hour(steady, "disk_blocks"), 1)
    for key in ("fds", "maps", "threads", "leases", "readers"):
        out[f"slope_{key}_per_h"] = round(slope_per_hour(steady, key), 2)
    return out


def summarize(samples: list[dict], results: list[dict], idle: dict, t0: float, args: argparse.Namespace,
              rc: int | None) -> dict:
    # Warm-up: the fixed share of the run, and at least until the disk tier holds its working set (98%
    # of its largest block count): before that the LMDB map's file-backed pages grow with the data.
    peak = max((s["disk_blocks"] for s in samples), default=0)
    settled = next((s["t"] for s in samples if s["disk_blocks"] >= 0.98 * peak), 0.0) if peak else 0.0
    warmup_s = max(args.warmup * args.duration, settled)
    fixed = [s for s in samples if s["t"] >= args.warmup * args.duration]
    steady = [s for s in samples if s["t"] >= warmup_s]
    totals = {k: sum(r[k] for r in results) for k in ("ops", "gets", "blocks_checked", "misses", "mismatches",
                                                       "errors", "reconnects", "full")}
    lat = sorted((t - t0, d) for r in results for t, d in r["lat"])
    window = 0.1 * args.duration
    first = [d for t, d in lat if warmup_s <= t < warmup_s + window]
    last = [d for t, d in lat if t >= args.duration - window]
    res = {
        "duration_s": args.duration, "clients": args.clients, "samples": len(samples),
        "warmup_s": round(warmup_s, 1), "disk_settled_s": round(settled, 1), **totals,
        "ops_per_s": round(totals["ops"] / args.duration, 1), **slopes(steady, fixed),
        "fds_range_steady": [min(s["fds"] for s in steady), max(s["fds"] for s in steady)] if steady else [],
        "readers_max": max(s["readers"] for s in samples), "shm_max": max(s["shm"] for s in samples),
        "idle": {k: idle[k] for k in ("leases", "clients", "fds", "threads", "readers", "anon_kb", "file_kb", "rss_kb")},
        "start": {k: samples[0][k] for k in ("fds", "threads", "anon_kb", "file_kb", "rss_kb")},
        "get_p99_ms_first_window": round(p99(first), 2), "get_p99_ms_last_window": round(p99(last), 2),
        "error_samples": sorted({e for r in results for e in r["error_samples"]})[:10],
        "daemon_sigterm_rc": rc,
    }
    return res


def broken(res: dict) -> bool:
    """Whether the run broke an invariant: a wrong block served, leases held when idle, /dev/shm entries."""
    return bool(res["mismatches"] or res["idle"]["leases"] or res["shm_max"])


def main() -> int:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="tierkv-soak-"))
    proc = rc = None
    try:
        if args.socket:
            sock = args.socket
        else:
            proc, sock = start_daemon(work)
        samples, results, idle, t0 = run_load(sock, args)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(120)
    res = summarize(samples, results, idle, t0, args, rc)
    print()
    width = max(len(k) for k in res)
    for k, v in res.items():
        print(f"{k:<{width}}  {v}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({**res, "series": samples + [idle]}, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    shutil.rmtree(work, ignore_errors=True)
    return 1 if broken(res) else 0


if __name__ == "__main__":
    sys.exit(main())

"""kill -9 loop: writers store blocks durably while the daemon is SIGKILLed at random moments.

Each loop starts the daemon on the same data dir, checks every block acknowledged so far (this loop's
new acks in full, a sample of older ones), checks that unacknowledged writes are absent or whole, then
lets ``--writers`` clients write durably and kills the daemon after a random delay. At the end every
acknowledged block is read back and the disk tier is scrubbed. Block bytes derive from their keys, so
the checker needs no memory of what was written.

    python tools/crashloop.py                  # 50 loops, 4 writers
    python tools/crashloop.py --loops 200 --large

Prints a table and writes bench-results/crashloop.json. Exit status 1 if any acknowledged block was
lost or wrong, an unacknowledged one came back partial, or a tierkv entry was left in /dev/shm.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import tierkv
from tierkv.client.admin import request
from tierkv.core.errors import ConnectionFailed, KeyMissing, TierKVError
from tierkv.daemon.malloc import TUNABLES

REPO = Path(__file__).resolve().parents[1]
SMALL = tierkv.Layout(2, 2, 32, 16, "bfloat16")  # 8 KiB blocks
LARGE = tierkv.Layout(4, 4, 64, 16, "bfloat16")  # 64 KiB blocks
MODEL = "crashloop"


def key_of(tag: str) -> bytes:
    return hashlib.blake2b(tag.encode(), digest_size=16).digest()


def values(keys: list[bytes], layout: tierkv.Layout) -> np.ndarray:
    """The oracle: each block's bytes derive from its key."""
    n = layout.block_bytes // 2
    out = np.empty((len(keys), n), np.uint16)
    for i, k in enumerate(keys):
        out[i] = np.random.default_rng(int.from_bytes(k[:8], "little")).integers(0, 1 << 16, n, np.uint16)
    return out.reshape(layout.batch_shape(len(keys)))


class Daemon:
    """A `tierkv serve` process on a fixed socket and data dir."""

    def __init__(self, work: Path, extra: list[str]) -> None:
        self.sockdir = Path(tempfile.mkdtemp(prefix="tkc-", dir="/tmp"))
        os.chmod(self.sockdir, 0o700)
        self.socket = str(self.sockdir / "s")
        self.data_dir = work / "data"
        self.log = work / "daemon.log"
        self.extra = extra
        self.proc: subprocess.Popen | None = None

    def start(self) -> float:
        cmd = [sys.executable, "-m", "tierkv", "serve", "--socket", self.socket, "--data-dir", str(self.data_dir),
               *self.extra]
        env = dict(os.environ, GLIBC_TUNABLES=TUNABLES, PYTHONUNBUFFERED="1")
        t0 = time.monotonic()
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        while time.monotonic() - t0 < 120:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                request(self.socket, "PING")
                return time.monotonic() - t0
            except ConnectionFailed:
                time.sleep(0.02)
        raise RuntimeError("daemon did not come up in 120 s")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.proc = None
        try:
            os.unlink(self.socket)
        except FileNotFoundError:
            pass

    def stop(self) -> int:
        if self.proc is None:
            return 0
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(120)
        self.proc = None
        return rc


def writer(sock: str, tag: str, layout: tierkv.Layout, acked: list, attempted: set, lock: threading.Lock,
           stop: threading.Event) -> None:
    try:
        c = tierkv.Client.connect(sock, model=MODEL, layout=layout)
    except TierKVError:
        return
    rng = random.Random(tag)
    try:
        for j in range(10**9):
            if stop.is_set():
                return
            keys = [key_of(f"{tag}/{j}/{i}") for i in range(rng.randint(1, 8))]
            with lock:
                attempted.update(keys)
            c.put(keys, values(keys, layout), durable=True)
            with lock:
                acked.extend(keys)
    except TierKVError:
        pass
    finally:
        c.close()


def check(c: tierkv.Client, keys: list[bytes], layout: tierkv.Layout) -> tuple[list[bytes], list[bytes]]:
    """(missing, wrong) among ``keys``."""
    missing: list[bytes] = []
    wrong: list[bytes] = []
    for i in range(0, len(keys), 256):
        part = keys[i:i + 256]
        try:
            got = c.get(part).view(torch.int16).numpy().view(np.uint16)
        except KeyMissing:
            for k in part:
                m, w = check(c, [k], layout) if len(part) > 1 else ([k], [])
                missing += m
                wrong += w
            continue
        want = values(part, layout)
        wrong += [k for j, k in enumerate(part) if not np.array_equal(got[j], want[j])]
    return missing, wrong


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loops", type=int, default=50)
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--min-s", type=float, default=0.2, help="shortest write window before the kill")
    ap.add_argument("--max-s", type=float, default=1.5, help="longest write window before the kill")
    ap.add_argument("--large", action="store_true", help="64 KiB blocks instead of 8 KiB")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=str(REPO / "bench-results" / "crashloop.json"))
    ap.add_argument("--keep", action="store_true", help="keep the data dir and daemon log")
    ap.add_argument("--chunk-blocks", type=int, default=0,
                    help="stream durable puts in chunks of this many blocks (COMMIT without wait, then SYNC)")
    return ap.parse_args()


@dataclass
class Tally:
    """What the writers acknowledged and attempted, and what the checks found, across loops."""

    acked: list[bytes] = field(default_factory=list)
    attempted: set[bytes] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    starts: list[float] = field(default_factory=list)
    lost: list[bytes] = field(default_factory=list)
    wrong: list[bytes] = field(default_factory=list)
    unacked_whole: int = 0
    unacked_absent: int = 0
    corrupt_at_scan: int = 0
    readers_max: int = 0
    checked_upto: int = 0


def check_after_restart(d: Daemon, t: Tally, layout: tierkv.Layout, rng: random.Random) -> None:
    """Every ack since the last check, a sample of older ones, and each unacknowledged write once."""
    with tierkv.Client.connect(d.socket, model=MODEL, layout=layout) as c:
        new = t.acked[t.checked_upto:]
        old = rng.sample(t.acked[:t.checked_upto], min(256, t.checked_upto))
        m, w = check(c, new + old, layout)
        t.lost += m
        t.wrong += w
        t.checked_upto = len(t.acked)
        acked_set = set(t.acked)
        pending = [k for k in t.attempted if k not in acked_set]
        for k in pending:
            if c.lookup([k]):
                if check(c, [k], layout) == ([], []):
                    t.unacked_whole += 1
                else:
                    t.wrong.append(k)
            else:
                t.unacked_absent += 1
        t.attempted -= set(pending)  # an unacknowledged key is judged once
    st = request(d.socket, "STATS")
    t.corrupt_at_scan += st["tiers"]["disk"]["corrupt"]
    t.readers_max = max(t.readers_max, st["tiers"]["disk"]["readers"])


def write_then_kill(d: Daemon, t: Tally, loop: int, layout: tierkv.Layout, rng: random.Random,
                    args: argparse.Namespace) -> None:
    """Run the writers for a random window, SIGKILL the daemon, and start it again."""
    stop = threading.Event()
    ws = [threading.Thread(target=writer, args=(d.socket, f"{loop}/{i}", layout, t.acked, t.attempted, t.lock, stop))
          for i in range(args.writers)]
    for w in ws:
        w.start()
    time.sleep(rng.uniform(args.min_s, args.max_s))
    d.kill()
    stop.set()
    for w in ws:
        w.join(60)
    t.starts.append(d.start())
    print(f"loop {loop + 1}/{args.loops}: {len(t.acked)} acks so far, restart {t.starts[-1]:.2f}s", flush=True)


def summary(t: Tally, d: Daemon, final: tuple[list[bytes], list[bytes]], scrub: dict, rc: int,
            shm_before: set[str], layout: tierkv.Layout, args: argparse.Namespace, seconds: float) -> dict:
    scans = [float(x) for x in re.findall(r"scanned in ([0-9.]+)s", d.log.read_text())]
    shm_after = {n for n in os.listdir("/dev/shm") if n.startswith("tierkv")}
    res = {
        "loops": args.loops, "writers": args.writers, "block_bytes": layout.block_bytes,
        "acked_blocks": len(t.acked), "lost": len(t.lost), "wrong": len(t.wrong), "final_lost": len(final[0]),
        "final_wrong": len(final[1]), "unacked_found_whole": t.unacked_whole, "unacked_absent": t.unacked_absent,
        "dropped_as_corrupt_at_start": t.corrupt_at_scan, "scrub_checked": scrub["checked"],
        "scrub_bad": len(scrub["bad"]), "max_reader_slots": t.readers_max,
        "restart_s_median": round(statistics.median(t.starts), 3), "restart_s_max": round(max(t.starts), 3),
        "scan_s_max": max(scans, default=0.0), "shm_leftovers": sorted(shm_after - shm_before),
        "final_sigterm_rc": rc, "seconds": round(seconds, 1),
    }
    return res


def broken(res: dict) -> bool:
    """Whether the run broke an invariant: a durable block lost or wrong, a partial block found, /dev/shm
    entries left behind."""
    keys = ("lost", "wrong", "final_lost", "final_wrong", "scrub_bad", "dropped_as_corrupt_at_start", "shm_leftovers")
    return any(res[k] for k in keys)


def main() -> int:
    args = parse_args()
    layout = LARGE if args.large else SMALL
    if args.chunk_blocks:
        importlib.import_module("tierkv.client.durable").DURABLE_CHUNK_BYTES = args.chunk_blocks * layout.block_bytes
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="tierkv-crashloop-"))
    d = Daemon(work, ["--host-capacity", "256MiB", "--disk-capacity", "4GiB", "--slab-bytes", "8MiB"])
    t = Tally()
    shm_before = {n for n in os.listdir("/dev/shm") if n.startswith("tierkv")}
    t_begin = time.monotonic()
    try:
        t.starts.append(d.start())
        for loop in range(args.loops + 1):
            check_after_restart(d, t, layout, rng)
            if loop == args.loops:
                break
            write_then_kill(d, t, loop, layout, rng, args)
        with tierkv.Client.connect(d.socket, model=MODEL, layout=layout) as c:
            final = check(c, t.acked, layout)
        scrub = request(d.socket, "VERIFY", {"drop": False})
        rc = d.stop()
    finally:
        if d.proc is not None:
            d.kill()
    res = summary(t, d, final, scrub, rc, shm_before, layout, args, time.monotonic() - t_begin)
    width = max(len(k) for k in res)
    print()
    for k, v in res.items():
        print(f"{k:<{width}}  {v}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(d.sockdir, ignore_errors=True)
    else:
        print(f"kept {work}")
    return 1 if broken(res) else 0


if __name__ == "__main__":
    sys.exit(main())

"""TTFT and decode speed of SmolLM2-135M-Instruct with tierkv attached, against recompute, in one run.

For cached prefixes of 512, 1,024 and 2,048 tokens plus a new 32-token suffix:

- recompute: the plain loop prefills prefix + suffix;
- host: the prefix is in the host tier (stored by a previous request);
- disk: the prefix is only on the disk tier (the daemon was restarted: SIGTERM flushes host blocks to
  disk and the new daemon starts with an empty host tier). While it is down the data files are dropped
  from the page cache (``posix_fadvise(DONTNEED)``); ``fincore`` reports how much of them is resident
  again when the restarted daemon is ready, i.e. whether the reads come from the page cache;

then decode speed of greedy generation from a 1,056-token prompt, the plain loop against the attached
loop (which stores generated blocks and samples attention every 16 steps), the two advanced in
lockstep one token at a time. Each figure is the median of ``--reps`` runs, interleaved so background
load hits all columns alike.

    .venv/bin/python tools/bench_ttft.py [--reps 3] [--attn sdpa|eager]

Prints a table and writes ``bench-results/bench_ttft.json``: TTFT of host and disk as ratios to
recompute's, decode speed of the attached loop as a ratio to the plain loop's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _conversation import SYSTEM
from _daemon_process import start_daemon, stop_daemon
from _demo_model import load_model, sidecar_threads

from tierkv.integrations.transformers import attach, plain_generate

ROOT = Path(__file__).resolve().parents[1]
MODEL_ID = "smollm2-135m-instruct"


class Daemon:
    """A daemon on a private socket and data dir, restartable to move the blocks to disk only."""

    def __init__(self, workdir: Path, host: str, disk: str) -> None:
        self.workdir = workdir
        self.socket = str(workdir / "s")
        self.data_dir = workdir / "data"
        self.args = ["--socket", self.socket, "--data-dir", str(self.data_dir), "--host-capacity", host,
                     "--disk-capacity", disk, "--log-level", "warning"]
        self.proc = None

    def start(self) -> None:
        self.proc = start_daemon(self.args, self.socket, self.workdir / "daemon.log")

    def stop(self) -> None:
        if self.proc is not None:
            rc = stop_daemon(self.proc)
            self.proc = None
            if rc != 0:
                raise SystemExit(f"daemon exited with {rc}; see {self.workdir / 'daemon.log'}")

    def restart(self) -> None:
        self.stop()
        self.start()

    def data_files(self) -> list[Path]:
        return [p for p in self.data_dir.rglob("*") if p.is_file()]

    def drop_page_cache(self) -> None:
        """Evict the (clean, synced) data files from the page cache."""
        for p in self.data_files():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def resident_bytes(self) -> int | None:
        """Bytes of the data files in the page cache (``fincore``), None if unavailable."""
        files = [str(p) for p in self.data_files()]
        if not files or not shutil.which("fincore"):
            return None
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *files],
                             capture_output=True, text=True, check=False)
        try:
            return sum(int(x) for x in out.stdout.split())
        except ValueError:
            return None


def tokens_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def make_prefix(tok, size: int) -> list[int]:
    """``size`` tokens of real text, distinct per size so no prefix is a prefix of another."""
    ids = tokens_of(tok, f"Document {size}. ")
    body = tokens_of(tok, SYSTEM)
    while len(ids) < size:
        ids += body
    return ids[:size]


def make_suffix(tok, size: int, tag: str, n: int = 32) -> list[int]:
    """``n`` new tokens; ``tag`` makes each one unique, so its blocks are never cached."""
    ids = tokens_of(tok, f"\nQuestion {tag} about document {size}: which rules apply to a member who "
                         "borrows the cement mixer, returns it late and broken, and asks for a refund?")
    assert len(ids) >= n, len(ids)
    return ids[:n]


def lockstep(a, b) -> tuple[float, float]:
    """Advance two generations one token at a time, alternately; returns the seconds each spent
    after its first token (its decode steps, and for the attached loop its stores and touches)."""
    its, spent = [iter(a), iter(b)], [0.0, 0.0]
    for it in its:
        next(it)  # the first token: prefill, not decode
    live = [True, True]
    while any(live):
        for i, it in enumerate(its):
            if not live[i]:
                continue
            t = time.perf_counter()
            try:
                next(it)
            except StopIteration:
                live[i] = False
            spent[i] += time.perf_counter() - t
    return spent[0], spent[1]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-prefix", type=int, default=1024)
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa",
                    help="attention kernel of the model (the attached loop samples eager attention either way)")
    ap.add_argument("--threads", type=int, default=sidecar_threads(),
                    help="torch threads (default: one core fewer than the machine, left to the daemon)")
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "bench_ttft.json"))
    return ap.parse_args()


def ttft_rows(model, tok, daemon: Daemon, prefixes: dict[int, list[int]], args: argparse.Namespace
              ) -> tuple[dict, list[dict]]:
    """TTFT samples per prefix size and tier, and the disk files' page-cache residency per repetition."""
    rows = {p: {k: [] for k in ("recompute", "host", "host_load", "host_prefill", "disk", "disk_load",
                                "disk_prefill")} for p in args.sizes}
    # Store every prefix once (a cold request through tierkv).
    with attach(model, daemon.socket, model_id=MODEL_ID) as lm:
        for p in args.sizes:
            lm.generate(prefixes[p], 1)
    # Each repetition restarts the daemon, which leaves every prefix on disk only (the data files
    # are dropped from the page cache while it is down; fincore tells what its start-up brought
    # back before the first read).
    resident = []
    for r in range(args.reps):
        daemon.stop()
        daemon.drop_page_cache()
        dropped = daemon.resident_bytes()
        daemon.start()
        before = daemon.resident_bytes()
        with attach(model, daemon.socket, model_id=MODEL_ID) as lm:
            resident.append({"after_fadvise": dropped, "before_reads": before,
                             "disk_tier_bytes": lm.client.stats()["tiers"]["disk"]["used_bytes"]})
            for p in args.sizes:
                ttft_of_size(model, tok, lm, prefixes[p], rows[p], p, r, args)
    return rows, resident


def ttft_of_size(model, tok, lm, prefix: list[int], row: dict, p: int, r: int, args: argparse.Namespace) -> None:
    """Back to back so background load hits all three alike: the prefix from disk (which promotes it),
    recompute, the prefix from host; the suffixes are new, so each tierkv run computes exactly the suffix."""
    for tier in ("disk", "recompute", "host"):
        # recompute and host run the same prompt (recompute stores nothing)
        tag = "disk" if tier == "disk" else "host"
        ids = prefix + make_suffix(tok, p, f"{tag}{r}", args.suffix)
        if tier == "recompute":
            ref = plain_generate(model, ids, 1)
            ref.run()
            row["recompute"].append(ref.stats.ttft_s)
            continue
        gen = lm.generate(ids, 1)
        assert gen.stats.cached_tokens == p, gen.stats
        assert gen.stats.cached_blocks_by_tier == {tier: p // 16}, gen.stats
        row[tier].append(gen.stats.ttft_s)
        row[f"{tier}_load"].append(gen.stats.load_s)
        row[f"{tier}_prefill"].append(gen.stats.prefill_s)
    assert gen.tokens == ref.tokens, "first token with tierkv differs from recompute"


def decode_rows(model, tok, daemon: Daemon, dec_ids: list[int], args: argparse.Namespace) -> tuple[dict, dict]:
    """Decode speed: the plain loop against the attached loop (prefix cached), advanced in lockstep,
    one token each in turn, so background load on this shared machine hits both alike. Also returns
    the daemon's stats at the end."""
    dec = {"plain": [], "attached": [], "attached_touches": [], "attached_stored": [], "same_tokens": []}
    with attach(model, daemon.socket, model_id=MODEL_ID) as lm:
        lm.generate(dec_ids, 1)
        for r in range(args.reps):
            ids = dec_ids + make_suffix(tok, 0, f"d{r}", args.suffix)
            ref = plain_generate(model, ids, args.decode_tokens, eos_token_id=[])
            gen = lm.stream(ids, args.decode_tokens, eos_token_id=[])
            plain_s, att_s = lockstep(ref, gen)
            steps = args.decode_tokens - 1
            dec["plain"].append(steps / plain_s)
            dec["attached"].append(steps / att_s)
            dec["same_tokens"].append(gen.tokens == ref.tokens)
            dec["attached_touches"].append(gen.stats.touches)
            dec["attached_stored"].append(gen.stats.stored_blocks)
        return dec, lm.client.stats()


def report_ttft(rows: dict, args: argparse.Namespace) -> dict:
    """Print the TTFT table; returns its figures per prefix size."""
    print(f"\nTTFT, SmolLM2-135M-Instruct float32 on CPU ({args.threads} torch threads, {args.attn} attention), "
          f"prefix + {args.suffix} new tokens, median of {args.reps}")
    hdr = (f"{'prefix':>7} {'recompute':>10} {'host':>9} {'ratio':>6} {'disk':>9} {'ratio':>6}   "
           "host: load+compute   disk: load+compute")
    print(hdr)
    print("-" * len(hdr))
    sizes = {}
    for p in args.sizes:
        r = rows[p]
        m = {k: median(v) for k, v in r.items()}
        fig = {"recompute_s": m["recompute"], "host_s": m["host"], "disk_s": m["disk"],
               "host_load_s": m["host_load"], "disk_load_s": m["disk_load"],
               "host_prefill_s": m["host_prefill"], "disk_prefill_s": m["disk_prefill"],
               "host_ratio": m["host"] / m["recompute"], "disk_ratio": m["disk"] / m["recompute"], "raw": r}
        sizes[str(p)] = fig
        print(f"{p:>7} {m['recompute'] * 1e3:8.0f}ms {m['host'] * 1e3:7.0f}ms {fig['host_ratio']:6.3f} "
              f"{m['disk'] * 1e3:7.0f}ms {fig['disk_ratio']:6.3f}   {m['host_load'] * 1e3:4.0f} + "
              f"{m['host_prefill'] * 1e3:4.0f} ms       {m['disk_load'] * 1e3:4.0f} + {m['disk_prefill'] * 1e3:4.0f} ms")
    return sizes


def report_decode(dec: dict, prompt_tokens: int, args: argparse.Namespace) -> dict:
    """Print the decode line; returns its figures."""
    plain_tps, att_tps = median(dec["plain"]), median(dec["attached"])
    print(f"\ndecode, {prompt_tokens}-token prompt, {args.decode_tokens} new tokens: plain "
          f"{plain_tps:.2f} tok/s, attached {att_tps:.2f} tok/s (ratio {att_tps / plain_tps:.3f}; "
          f"{median(dec['attached_touches']):.0f} touches, "
          f"{median(dec['attached_stored']):.0f} blocks stored)")
    return {"prompt_tokens": prompt_tokens, "new_tokens": args.decode_tokens,
            "plain_tokens_per_s": plain_tps, "attached_tokens_per_s": att_tps,
            "ratio": att_tps / plain_tps, "raw": dec}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    tok, model = load_model(attn_implementation=args.attn)
    work = Path(tempfile.mkdtemp(prefix="tkvb-", dir="/tmp"))
    os.chmod(work, 0o700)
    daemon = Daemon(work, host="1GiB", disk="4GiB")
    daemon.start()
    try:
        prefixes = {p: make_prefix(tok, p) for p in args.sizes}
        rows, resident = ttft_rows(model, tok, daemon, prefixes, args)
        dec_ids = prefixes[max(args.sizes)][:args.decode_prefix]
        dec, stats = decode_rows(model, tok, daemon, dec_ids, args)
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)

    res: dict = {"config": vars(args), "sizes": report_ttft(rows, args),
                 "decode": report_decode(dec, len(dec_ids) + args.suffix, args), "disk_page_cache": resident,
                 "env": {"torch": torch.__version__, "python": platform.python_version(),
                         "cpu": platform.processor(), "threads": args.threads, "loadavg_start": load0,
                         "loadavg_end": os.getloadavg()},
                 "daemon_stats": stats}
    print("disk data files in the page cache (fincore): "
          + "; ".join(f"{x['after_fadvise']} B after fadvise, {x['before_reads']} B when the restarted daemon "
                      f"was ready (the disk tier holds {x['disk_tier_bytes']} B)" for x in resident))
    print(f"load average {load0[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=str))
    print(f"wrote {out}")
    sys.exit(0)


if __name__ == "__main__":
    main()

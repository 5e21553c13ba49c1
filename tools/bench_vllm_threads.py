"""vLLM's CPU build beside a busy process: how its OpenMP threads are set decides what one busy core costs.

vLLM alone (no connector) serves the same greedy requests under three thread settings, each on an idle
machine and beside one process spinning on a core (as the daemon, a test or a second worker would):
- ``pinned``: one thread bound to every core (``VLLM_CPU_OMP_THREADS_BIND=0-{n-1}``, what the serving
  benchmarks use for every configuration);
- ``one``: one unbound thread (``nobind``, ``OMP_NUM_THREADS=1``, what the test suite runs);
- ``two-passive``: two unbound threads that sleep at a barrier (``OMP_WAIT_POLICY=PASSIVE``).

Per setting: wall seconds of N requests one after another and of N at once, idle and beside the spinner,
and their ratio (beside / idle).

    python tools/bench_vllm_threads.py                  # 4 requests of 64 tokens each way
    python tools/bench_vllm_threads.py --requests 2 --tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _demo_model import ensure_converted
from _vllm_server import VllmServer

SETTINGS: dict[str, dict[str, str]] = {
    "pinned": {"VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}"},
    "one": {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"},
    "two-passive": {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
}
PROMPT = "Write a long list of tools a neighbourhood library could lend, one per line, with a short note each."


def timed(server: VllmServer, n: int, tokens: int, at_once: bool) -> float:
    """Wall seconds of ``n`` greedy chat requests of ``tokens`` tokens, one after another or all at once."""
    def one(i: int) -> None:
        server.chat([{"role": "user", "content": f"{PROMPT} ({i})"}], max_tokens=tokens,
                    extra={"ignore_eos": True})
    t0 = time.perf_counter()
    if at_once:
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(one, range(n)))
    else:
        for i in range(n):
            one(i)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default="bench-results/vllm_threads.json")
    args = ap.parse_args()
    if args.requests < 1 or args.tokens < 1:
        ap.error("--requests and --tokens must be at least 1")
    model = ensure_converted()
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, env in SETTINGS.items():
            server = VllmServer(str(model), None, Path(tmp) / f"{name}.log", env=env).start()
            try:
                timed(server, 1, 8, False)  # warm-up: the first forward passes compile
                row: dict[str, float] = {}
                for mode in ("sequential", "at_once"):
                    idle = timed(server, args.requests, args.tokens, mode == "at_once")
                    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    try:
                        time.sleep(0.5)
                        busy = timed(server, args.requests, args.tokens, mode == "at_once")
                    finally:
                        spinner.kill()
                        spinner.wait()
                    row |= {f"{mode}_idle_s": round(idle, 2), f"{mode}_beside_spinner_s": round(busy, 2),
                            f"{mode}_ratio": round(busy / idle, 2)}
                results[name] = row
            finally:
                server.stop()
            print(f"{name:12s} " + "  ".join(f"{k} {v}" for k, v in results[name].items()), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"requests": args.requests, "tokens": args.tokens,
                                          "cores": os.cpu_count(), "settings": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Per model architecture the vLLM connector serves: warm TTFT (the prompt served from tierkv after vLLM
restarts) against recompute, and bytes loaded per hit against loading every block.

Architectures: SmolLM2-135M (full attention, the reference), and random-weight models larger than the
tests' (``tools/_random_models.py``, size ``bench``): Gemma-3 text (5 sliding-window layers per
full one, window 512), Mistral (a 512-token window on every layer), DeepSeek-V2-style MLA (bfloat16, dense MLP layers: vLLM's CPU MoE router takes no ungrouped top-k).

Per architecture, one after the other: a daemon and a vLLM server with the tierkv connector; the prompt
(``--prompt-tokens`` token ids) is sent once and stored; vLLM restarts (its own cache empty); then ``--reps``
times: the prompt (warm: served from tierkv; vLLM's prefix cache is reset before each) and the prompt under a
fresh ``cache_salt`` no block was stored with (recompute). TTFT is the time of a one-token completion as the
client sees it. Bytes per hit come from the connector's counters on vLLM's /metrics
(``vllm:tierkv_load_bytes_total``, ``vllm:tierkv_window_saved_bytes_total``); every block is load + saved.

    python tools/bench_models.py --out models.json
    python tools/bench_models.py --archs smollm2 mistral --reps 1     # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import _random_models as random_models
from _benchd import Daemon
from _demo_model import ensure_converted
from _vllm_server import BLOCK_TOKENS, VllmServer

ARCHS = ("smollm2", *(a for a in random_models.ARCHS if a in random_models.SIZES["bench"]))
DTYPE = {"deepseek": "bfloat16"}  # vLLM's CPU MoE takes no float32; the others float32
KIND = {"smollm2": "full attention", "gemma3": "sliding 5:1 full", "mistral": "sliding (all layers)",
        "deepseek": "MLA latent"}
MIB = 1 << 20


def vllm_pids() -> dict[int, int]:
    """Running ``VLLM::`` processes: pid -> session id."""
    out = subprocess.run(["ps", "-eo", "pid=,sid=,args="], capture_output=True, text=True).stdout
    return {int(p): int(s) for p, s, *rest in (ln.split(None, 2) for ln in out.splitlines())
            if rest and "VLLM::" in rest[0]}


def wait_free(poll_s: float = 5.0) -> None:
    """Wait until no VLLM:: process runs (others share the cores)."""
    shown = False
    while vllm_pids():
        if not shown:
            print("  (waiting: VLLM:: processes running)", flush=True)
            shown = True
        time.sleep(poll_s)


def stop(server: VllmServer) -> None:
    """Stop ``server`` and kill any VLLM:: process left in its session."""
    sid = server.proc.pid if server.proc else None
    server.stop()
    for pid, s in vllm_pids().items():
        if s == sid:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def timed(server: VllmServer, prompt: list[int], salt: str | None = None) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = server.complete(prompt, max_tokens=1, salt=salt)
    return time.perf_counter() - t0, r["cached_tokens"]


def run_arch(arch: str, work: Path, prompt: list[int], reps: int) -> dict:
    model = ensure_converted() if arch == "smollm2" else random_models.make(arch, work / "models", size="bench")
    dtype = DTYPE.get(arch, "float32")
    hit = (len(prompt) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    sock = tempfile.mkdtemp(prefix="tkvbm-", dir="/tmp") + "/s"
    daemon = Daemon(work / f"data-{arch}", sock, ["--host-capacity", "4GiB", "--slab-bytes", "32MiB"]).start()
    try:
        wait_free()
        s = VllmServer(str(model), sock, work / f"vllm-{arch}-store.log", dtype=dtype).start()
        try:
            timed(s, [1, 2, 3])  # the server's first request
            first_s, _ = timed(s, prompt)
        finally:
            stop(s)
        wait_free()
        s = VllmServer(str(model), sock, work / f"vllm-{arch}-restart.log", dtype=dtype,
                       env={"VLLM_SERVER_DEV_MODE": "1"}).start()
        try:
            timed(s, [1, 2, 3])
            warm, recompute, cached = [], [], []
            for r in range(reps):
                if r:
                    s.reset_prefix_cache()
                t, c = timed(s, prompt)
                warm.append(t)
                cached.append(c)
                recompute.append(timed(s, prompt, salt=f"bench-{r}")[0])
            deadline = time.monotonic() + 30  # the counters reach /metrics with vLLM's periodic stats
            while s.metric("vllm:tierkv_hit_tokens_total") < reps * hit and time.monotonic() < deadline:
                timed(s, [1, 2, 3])
                time.sleep(0.5)
            c = {n: s.metric(f"vllm:tierkv_{n}_total")
                 for n in ("hit_tokens", "load_bytes", "window_saved_bytes", "load_errors")}
        finally:
            stop(s)
    finally:
        daemon.stop()
        shutil.rmtree(Path(sock).parent, ignore_errors=True)
    hits = c["hit_tokens"] / hit if hit else 0
    load = c["load_bytes"] / hits if hits else 0.0
    every = (c["load_bytes"] + c["window_saved_bytes"]) / hits if hits else 0.0
    w, rc = statistics.median(warm), statistics.median(recompute)
    return {"arch": arch, "kind": KIND[arch], "dtype": dtype, "prompt_tokens": len(prompt), "hit_tokens": hit,
            "cached_tokens": cached, "first_s": first_s, "warm_s": warm, "recompute_s": recompute,
            "warm_median_s": w, "recompute_median_s": rc, "recompute_over_warm": rc / w if w else 0.0,
            "hits": hits, "load_errors": c["load_errors"], "load_bytes_per_hit": load,
            "every_block_bytes_per_hit": every, "load_over_every": load / every if every else 0.0}


def table(rows: list[dict]) -> str:
    head = (f"{'model':<9} {'KV':<21} {'cached':>7} {'recompute s':>11} {'warm s':>7} {'ratio':>6} "
            f"{'MiB/hit':>8} {'every MiB':>9} {'loaded':>7}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['arch']:<9} {r['kind']:<21} {min(r['cached_tokens']):>7} {r['recompute_median_s']:>11.3f} "
                     f"{r['warm_median_s']:>7.3f} {r['recompute_over_warm']:>5.2f}x "
                     f"{r['load_bytes_per_hit'] / MIB:>8.1f} {r['every_block_bytes_per_hit'] / MIB:>9.1f} "
                     f"{r['load_over_every']:>7.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=3, help="warm and recompute requests per architecture")
    ap.add_argument("--work", type=Path, default=None, help="models, logs, daemon data (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="bench-models-"))
    prompt = [1000 + (i * 7919) % 40000 for i in range(a.prompt_tokens)]
    print(f"prompt {a.prompt_tokens} tokens, {a.reps} reps, {os.cpu_count()} cores; work {work}", flush=True)
    rows = []
    for arch in a.archs:
        t0 = time.monotonic()
        rows.append(run_arch(arch, work, prompt, a.reps))
        print(f"  {arch}: {time.monotonic() - t0:.0f} s", flush=True)
    print("TTFT: median of one-token completions; ratio = recompute / warm; MiB/hit = loaded from tierkv per hit;"
          "\nevery MiB = load + window-saved bytes per hit; loaded = MiB/hit / every MiB")
    print(table(rows))
    if a.out:
        a.out.write_text(json.dumps({"prompt_tokens": a.prompt_tokens, "reps": a.reps, "cores": os.cpu_count(),
                                     "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

"""A quiet tenant beside a noisy one on vLLM's OpenAI server with tierkv, driven by vLLM's own benchmark
client (two clients at once, each with its tenant's ``cache_salt``).

The quiet tenant runs multi-turn chats (shared system prompts, earlier turns: reuse); the noisy tenant
floods with prompts that share nothing. tierkv's host tier holds the quiet tenant's working set and a
little more, with no disk tier, so a block pushed out is gone. Three runs, each on a fresh daemon and
server: the quiet tenant ``alone``; with the ``flood`` and no quota; with the flood and a host quota for
the quiet tenant the size of its working set (``quota``, set through the control API before the load).

Per run: the quiet tenant's TTFT p50/p99 and TPOT p50 from its client, the prompt tokens the connector
served over the run (vLLM's ``external_prefix_cache_hits``, both tenants), and per tenant the blocks the
daemon served it and the blocks its engine computed (``GET /v1/tenants``: each tenant is accounted by a
quota on the disk tier, which this daemon does not run, so it bounds nothing). ``--store-gate all``
stores every block the noisy tenant computes, as a flood the store gate would keep (one whose prompts do
come back) is stored.

    python tools/bench_tenants.py                      # JSON in bench-results/bench_tenants.json
    python tools/bench_tenants.py --store-gate all --out bench-results/bench_tenants_all.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import _serving_workloads as workloads
from _benchd import Daemon
from _demo_model import ensure_converted
from _serving_client import run_client
from _serving_configs import CappedServer, _vllm
from _vllm_server import connector_config, free_port
from bench_serving import block_bytes

MIB = 1 << 20
TOKEN = "bench-tenants-control-token"


@contextlib.contextmanager
def stack(model: str, work: Path, host_bytes: int, vllm_blocks: int,
          gate: str) -> Iterator[tuple[CappedServer, int]]:
    """A daemon (host tier only, its control API on) and vLLM with tierkv's connector; yields the
    server and the control port."""
    work.mkdir(parents=True, exist_ok=True)
    token, port, sock = work / "token", free_port(), str(work / "tierkv.sock")
    token.write_text(TOKEN)
    token.chmod(0o600)
    daemon = Daemon(work / "tierkv-data", sock, ["--host-capacity", f"{max(1, host_bytes // MIB)}MiB", "--no-disk",
                                                 "--metrics-addr", str(port), "--control-token-file", str(token)],
                    env={"TIERKV_STORE_GATE": gate})
    daemon.start()
    try:
        kv = connector_config(None)
        kv["kv_connector_extra_config"] = {"socket": sock}
        with _vllm(CappedServer(model, None, connector=kv, log_path=work / "vllm.log", num_blocks=vllm_blocks)) as s:
            yield s, port
    finally:
        daemon.stop()


def control(port: int, op: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/{op}", method="GET" if body is None else "POST",
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def run(name: str, args: argparse.Namespace, model: str, work: Path, quiet: workloads.Workload,
        noisy: workloads.Workload, host: int, quiet_bytes: int) -> dict:
    out: dict = {"run": name, "host_bytes": host}
    t0 = time.monotonic()
    with stack(model, work / name, host, args.vllm_blocks, args.store_gate) as (server, port):
        for tenant in ("quiet", "noisy"):  # accounted: a quota on the disk tier, which this daemon has not
            control(port, "quotas", {"tenant": tenant, "disk": 1 << 50})
        if name == "quota":
            control(port, "quotas", {"tenant": "quiet", "host": quiet_bytes})
        flood: dict = {}

        def noisy_client() -> None:
            flood.update(run_client(server.url, model, server.name, noisy, work / name / "noisy.jsonl",
                                    work / name / "noisy.json", work / name / "noisy.log", {"cache_salt": "noisy"}))
        thread = threading.Thread(target=noisy_client) if name != "alone" else None
        if thread is not None:
            thread.start()
        out["quiet"] = run_client(server.url, model, server.name, quiet, work / name / "quiet.jsonl",
                                  work / name / "quiet.json", work / name / "quiet.log", {"cache_salt": "quiet"})
        if thread is not None:
            thread.join()
            out["noisy"] = {k: flood.get(k) for k in ("completed", "mean_ttft_ms", "request_throughput")}
        out["tenants"] = control(port, "tenants")["tenants"]
    out["wall_s"] = time.monotonic() - t0
    q, t = out["quiet"], out["tenants"]
    per = ", ".join(f"{k} served {v['hits']} / computed {v['misses']} blocks" for k, v in t.items())
    print(f"[{name}] quiet TTFT p50 {q['p50_ttft_ms']:.0f} ms, p99 {q['p99_ttft_ms']:.0f} ms, TPOT p50 "
          f"{q['p50_tpot_ms']:.1f} ms, connector tokens {q['counters']['vllm:external_prefix_cache_hits']:.0f} "
          f"of {q['counters']['vllm:prompt_tokens']:.0f} prompt tokens; {per} ({out['wall_s']:.0f} s)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quiet-requests", type=int, default=48)
    ap.add_argument("--quiet-rate", type=float, default=0.6, help="quiet tenant's requests/s")
    ap.add_argument("--noisy-requests", type=int, default=80)
    ap.add_argument("--noisy-rate", type=float, default=0.25, help="noisy tenant's requests/s")
    ap.add_argument("--host-share", type=float, default=1.25, help="host tier / the quiet tenant's working set")
    ap.add_argument("--vllm-blocks", type=int, default=32, help="vLLM's own KV blocks of 128 tokens")
    ap.add_argument("--runs", default="alone,flood,quota")
    ap.add_argument("--store-gate", choices=["predicted", "all"], default="predicted",
                    help="the daemon's store.gate: all stores every block (the flood too)")
    ap.add_argument("--out", default="bench-results/bench_tenants.json")
    args = ap.parse_args()
    model = str(ensure_converted())
    bb = block_bytes(model)
    quiet = workloads.build("chat", args.quiet_requests, args.quiet_rate, max_output=16, chat_turns=6.0)
    noisy = workloads.build("unique", args.noisy_requests, args.noisy_rate, max_output=16, seed=7)
    quiet_bytes = quiet.working_set_blocks() * bb
    host = int(quiet_bytes * args.host_share)
    print(f"quiet: {len(quiet.rows)} chat turns, working set {quiet_bytes / 1e9:.2f} GB; noisy: "
          f"{len(noisy.rows)} unique prompts, {noisy.working_set_blocks() * bb / 1e9:.2f} GB; host tier "
          f"{host / 1e9:.2f} GB, no disk", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-tenants-") as tmp:
        results = [run(name, args, model, Path(tmp), quiet, noisy, host, quiet_bytes)
                   for name in args.runs.split(",")]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "runs": results}, indent=1, default=str))
    base = {r["run"]: r["quiet"] for r in results}
    if "alone" in base:
        a = base["alone"]
        for name in ("flood", "quota"):
            if name in base:
                q = base[name]
                served = {r["run"]: r["tenants"]["quiet"]["hits"] for r in results}
                print(f"{name} / alone: TTFT p50 {q['p50_ttft_ms'] / a['p50_ttft_ms']:.2f}x  p99 "
                      f"{q['p99_ttft_ms'] / a['p99_ttft_ms']:.2f}x  quiet blocks served "
                      f"{served[name] / max(1, served['alone']):.2f}x")


if __name__ == "__main__":
    main()

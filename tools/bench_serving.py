"""vLLM's OpenAI server under load, driven by vLLM's own benchmark client: vLLM alone, vLLM + tierkv
and vLLM + LMCache (MP mode), one after the other in one invocation.

Workloads (Mooncake-format traces replayed on their own clock by the client's ``timed_trace``
dataset; see tools/_serving_workloads.py): ``trace`` (a window of the shared Mooncake synthetic
trace), ``chat`` (multi-turn conversations, Poisson starts), ``unique`` (prompts that share nothing),
``long`` (4k-8k-token prompts sharing
documents). Pressures: the host tier holds the workload's working set (``full``) or a quarter of it
(``quarter``; the rest on disk). vLLM's own KV cache is ``--vllm-blocks`` blocks of 128 tokens.

Per configuration, workload and pressure: TTFT p50/p99, TPOT p50/p99, ITL p99, requests/s, output
tokens/s, prompt tokens served from cache (vLLM's counters, over the client's run), failed requests;
ratios against vLLM alone and LMCache of the same run; and whether greedy replies to fixed prompts,
sent twice after the load, equal vLLM alone's.

    tools/lmcache_env.sh                                 # LMCache's venv, once (or set LMCACHE_VENV)
    python tools/bench_serving.py                        # every configuration, workload and pressure
    python tools/bench_serving.py --workloads trace --pressures full --requests 8 --trace-rate 1  # a smoke test
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import _serving_configs as configs
import _serving_workloads as workloads
from _demo_model import ensure_converted
from _serving_client import run_client, scrape
from _serving_report import load_report, print_tables
from _vllm_server import BLOCK_TOKENS, VllmServer

PRESSURES = {"full": 1.0, "quarter": 0.25}


def block_bytes(model_dir: str, block_tokens: int = BLOCK_TOKENS) -> int:
    """Bytes of one vLLM KV block of the model in float32 (keys and values of every layer)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * block_tokens * 4


def check_prompts(n: int) -> list[list[dict[str, str]]]:
    """``n`` fixed chats of about 1,700 tokens each: ``n`` of them overflow a 65-block vLLM cache, so the
    second pass of :func:`greedy_replies` reads them back through the connector."""
    out = []
    for k in range(n):
        notes = " ".join(f"Entry {k}.{i}: crate {(k * 31 + i * 7) % 113} left dock {i % 9} at {i % 24:02d}:"
                         f"{(i * 13) % 60:02d} holding {(i * k + 5) % 40} boxes of part {(k + i * 3) % 71}."
                         for i in range(60))
        out.append([{"role": "system", "content": f"You keep the ledger of warehouse {k}. {notes}"},
                    {"role": "user", "content": "Which crate left dock 3 first, and what did it hold?"}])
    return out


def greedy_replies(server: VllmServer, n: int, max_tokens: int) -> list[str]:
    """Greedy replies to :func:`check_prompts`, sent in order twice."""
    prompts = check_prompts(n)
    return [server.chat(p, max_tokens=max_tokens).text for _ in range(2) for p in prompts]


def run_one(cfg: str, wl: workloads.Workload, pressure: str, args: argparse.Namespace, model: str,
            work: Path, bb: int, host_bytes: int | None = None) -> dict:
    """One configuration under one workload at one pressure (``host_bytes``: the host tier's size
    instead of the pressure's share of the working set)."""
    ws = wl.working_set_blocks() * bb
    host = int(ws * PRESSURES[pressure]) if host_bytes is None else host_bytes
    disk = 2 * ws + 256 * configs.MIB
    run = work / f"{wl.name}-{pressure}-{cfg}"
    out: dict = {"config": cfg, "workload": wl.name, "pressure": pressure, "host_bytes": host, "disk_bytes": disk}
    t0 = time.monotonic()
    print(f"[{wl.name}/{pressure}/{cfg}] host tier {host / 1e9:.2f} GB, starting ...", flush=True)
    try:
        extra = {} if args.sync_load_mib is None else {"sync_load_max_mib": args.sync_load_mib}
        with configs.start(cfg, model, run, host_bytes=host, disk_bytes=disk, vllm_blocks=args.vllm_blocks,
                           tierkv_extra=extra) as server:
            out["start_s"] = time.monotonic() - t0
            out["client"] = run_client(server.url, model, server.name, wl, run / "trace.jsonl",
                                       run / "result.json", run / "client.log")
            before = scrape(server.url)
            out["greedy"] = greedy_replies(server, args.check_prompts, args.check_tokens)
            after = scrape(server.url)
            out["greedy_counters"] = {k: after[k] - before[k] for k in after}
    except Exception as e:  # noqa: BLE001 - a configuration that fails is reported, the others still run
        out["error"] = f"{type(e).__name__}: {e}"
        print(f"[{wl.name}/{pressure}/{cfg}] FAILED: {out['error']}", flush=True)
    out["wall_s"] = time.monotonic() - t0
    check = out.get("greedy_counters", {})
    print(f"[{wl.name}/{pressure}/{cfg}] done in {out['wall_s']:.0f} s (start {out.get('start_s', 0):.0f} s); "
          f"greedy check: {check.get('vllm:external_prefix_cache_hits', 0):.0f} of "
          f"{check.get('vllm:prompt_tokens', 0):.0f} prompt tokens from the connector", flush=True)
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="vllm,tierkv,lmcache", help="of: " + ",".join(configs.NAMES))
    ap.add_argument("--workloads", default="trace,chat,long", help="of: " + ",".join(workloads.NAMES))
    ap.add_argument("--pressures", default="full,quarter", help="of: " + ",".join(PRESSURES))
    ap.add_argument("--requests", type=int, default=200, help="requests of the trace, chat and unique workloads")
    ap.add_argument("--long-requests", type=int, default=60, help="requests of the long workload")
    ap.add_argument("--trace-start", type=int, default=workloads.TRACE_START, help="trace: first row of the window")
    ap.add_argument("--trace-chunk", type=int, default=16, help="trace: tokens per 512-token id")
    ap.add_argument("--sync-load-mib", type=float, help="tierkv: the connector's sync_load_max_mib (default: none)")
    add_run_args(ap, chat_rate=0.15, check_prompts=5, out="bench-results/bench_serving.json")
    return ap.parse_args()


def _turns(text: str) -> float:
    try:
        turns = float(text)
    except ValueError:
        turns = 0.0
    if not turns >= 1:
        raise argparse.ArgumentTypeError(f"a mean of at least 1 turn per conversation, got {text!r}")
    return turns


def add_run_args(ap: argparse.ArgumentParser, *, chat_rate: float, check_prompts: int, out: str) -> None:
    """The options every serving benchmark takes: workload rates, output length, vLLM's cache, the
    greedy check, seed, work folder, output and ``--report``."""
    ap.add_argument("--trace-rate", type=float, default=0.25, help="trace: mean requests/s (the clock stretched)")
    ap.add_argument("--chat-rate", type=float, default=chat_rate, help="chat: mean requests/s")
    ap.add_argument("--chat-turns", type=_turns, default=4.0, help="chat: mean turns per conversation (>= 1)")
    ap.add_argument("--long-rate", type=float, default=0.04, help="long: requests/s")
    ap.add_argument("--unique-rate", type=float, default=0.5, help="unique: requests/s")
    ap.add_argument("--max-output", type=int, default=16, help="output tokens per request, at most")
    ap.add_argument("--vllm-blocks", type=int, default=65,
                    help="vLLM's own KV cache per instance, 128-token blocks (requests clipped to one block less)")
    ap.add_argument("--check-prompts", type=int, default=check_prompts, help="fixed prompts of the greedy check")
    ap.add_argument("--check-tokens", type=int, default=24, help="greedy reply tokens per check prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", help="folder for logs and tiers (default: a temporary one, removed at the end)")
    ap.add_argument("--out", default=out)
    ap.add_argument("--report", metavar="JSON", help="print the table(s) of a saved run and exit (nothing runs)")


def main() -> None:
    args = parse_args()
    if args.report:
        print_tables(load_report(args.report))
        return
    cfgs, names, pressures = (args.configs.split(","), args.workloads.split(","), args.pressures.split(","))
    for given, known in ((cfgs, configs.NAMES), (names, workloads.NAMES), (pressures, tuple(PRESSURES))):
        if bad := [x for x in given if x not in known]:
            raise SystemExit(f"unknown {', '.join(bad)} (one of {', '.join(known)})")
    model = str(ensure_converted())
    bb = block_bytes(model)
    rates = {"trace": args.trace_rate, "chat": args.chat_rate, "long": args.long_rate, "unique": args.unique_rate}
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-serving-"))
    report: dict = {"args": vars(args), "block_bytes": bb, "workloads": {}, "runs": []}
    max_len = configs.max_request_len(args.vllm_blocks)
    try:
        for name in names:
            count = args.long_requests if name == "long" else args.requests
            wl = workloads.build(name, count, rates[name], max_output=args.max_output, seed=args.seed,
                                 trace_start=args.trace_start, trace_chunk=args.trace_chunk,
                                 chat_turns=args.chat_turns, max_len=max_len)
            summary = wl.summary()
            summary["working_set_bytes"] = summary["working_set_blocks"] * bb
            summary["reusable"] = wl.reusable(args.vllm_blocks)
            report["workloads"][name] = summary
            print(f"[{name}] {summary['requests']} requests over {summary['duration_s']:.0f} s, prompts "
                  f"{summary['mean_prompt_tokens']:.0f} tokens on average (at most {summary['max_prompt_tokens']}), "
                  f"working set {summary['working_set_blocks']} blocks = {summary['working_set_bytes'] / 1e9:.2f} GB",
                  flush=True)
            for i, pressure in enumerate(pressures):
                for cfg in cfgs:
                    if cfg == "vllm" and i > 0:
                        continue  # no host tier: one run serves every pressure
                    report["runs"].append(run_one(cfg, wl, pressure, args, model, work, bb))
                    _save(report, args.out)
        print_tables(report)
        _save(report, args.out)
    finally:
        if not args.work and not any("error" in r for r in report["runs"]):
            shutil.rmtree(work, ignore_errors=True)
        elif report["runs"]:
            print(f"logs kept in {work}")


def _save(report: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

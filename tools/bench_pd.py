"""Prefill/decode disaggregation through tierkv against one instance on the same workload, driven by
vLLM's own benchmark client (tools/bench_serving.py's servers, daemon, client and workloads).

- ``single``: one vLLM with the tierkv connector (``kv_role`` ``kv_both``) and the daemon;
- ``pd``: a prefill vLLM (``kv_producer``) and a decode vLLM (``kv_consumer``) on one daemon, the
  client talking to ``python -m tierkv pd-proxy`` in front of them.

Every vLLM binds all of the machine's cores, so ``pd``'s two instances share the cores ``single`` has
to itself. The host tier holds the workload's working set and the check prompts; vLLM's own cache is ``--vllm-blocks`` blocks
of 128 tokens per instance. Per configuration: TTFT p50/p99, TPOT p50/p99, requests/s, output tokens/s,
the prompt tokens the answering instance (``pd``: the decode) took from its own cache (device) and from
tierkv (connector), failed requests, and how many greedy replies to fixed prompts, each sent twice
after the load, differ from ``single``'s; then the pd/single ratios.

    python tools/bench_pd.py                                                 # chat, 24 requests
    python tools/bench_pd.py --requests 6 --chat-rate 2 --check-prompts 1   # a smoke test
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import _serving_workloads as workloads
from _demo_model import ensure_converted
from _serving_configs import max_request_len
from _serving_report import COLUMNS, _cell, _ratio, figures, load_report
from bench_serving import add_run_args, block_bytes, run_one

MIB = 1 << 20
CHECK_BLOCKS = 16  # 128-token blocks of one greedy-check prompt, at most
CONFIGS = {"single": "tierkv", "pd": "pd"}  # name here -> configuration of tools/_serving_configs.py
SHOWN = ("config", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "requests_per_s",
         "output_tokens_per_s", "cached_pct", "device_hit_tokens", "connector_hit_tokens", "failed", "greedy_diff")
RATIOS = (("TTFT p50", "ttft_p50_ms"), ("TTFT p99", "ttft_p99_ms"), ("TPOT p50", "tpot_p50_ms"),
          ("TPOT p99", "tpot_p99_ms"), ("req/s", "requests_per_s"))


def print_table(report: dict) -> None:
    """The figures of each run, then pd/single; each run's figures are stored under ``"figures"``."""
    wl = report["workload"]
    runs = report["runs"]
    single = next((r for r in runs if r["config"] == "single" and "greedy" in r), None)
    print(f"\n{wl['name']}: {wl['requests']} requests, prompts {wl['mean_prompt_tokens']:.0f} tokens on average; "
          "latencies in ms; cached: prompt tokens the answering instance served from its cache (device) or "
          "tierkv (connector)")
    cols = [c for k in SHOWN for c in COLUMNS if c[2] == k]
    print("  ".join(f"{h:>{w}}" for h, w, _ in cols))
    figs: dict[str, dict] = {}
    for r in runs:
        if "error" in r:
            print(f"{r['config']:>8}  failed: {r['error'].splitlines()[0]}")
            continue
        f = r["figures"] = figures(r, single["greedy"] if single else None)
        figs[r["config"]] = f
        print("  ".join(_cell(f[k], w) for _h, w, k in cols))
    if "pd" in figs and "single" in figs:
        print("  pd / single: " + "  ".join(f"{h} {_ratio(figs['pd'][k], figs['single'][k])}" for h, k in RATIOS))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="single,pd", help="of: " + ",".join(CONFIGS))
    ap.add_argument("--workload", default="chat", choices=workloads.NAMES)
    ap.add_argument("--requests", type=int, default=24)
    add_run_args(ap, chat_rate=0.5, check_prompts=2, out="bench-results/bench_pd.json")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.report:
        print_table(load_report(args.report))
        return
    cfgs = args.configs.split(",")
    if bad := [c for c in cfgs if c not in CONFIGS]:
        raise SystemExit(f"unknown {', '.join(bad)} (one of {', '.join(CONFIGS)})")
    model = str(ensure_converted())
    bb = block_bytes(model)
    rate = {"chat": args.chat_rate, "trace": args.trace_rate, "long": args.long_rate}[args.workload]
    wl = workloads.build(args.workload, args.requests, rate, max_output=args.max_output, seed=args.seed,
                         chat_turns=args.chat_turns, max_len=max_request_len(args.vllm_blocks))
    report: dict = {"args": vars(args), "block_bytes": bb, "workload": {"name": wl.name, **wl.summary()}, "runs": []}
    print(f"[{wl.name}] {len(wl.rows)} requests over {report['workload']['duration_s']:.0f} s", flush=True)
    # the host tier holds the working set and the greedy check's prompts (up to 16 blocks each)
    host = (wl.working_set_blocks() + CHECK_BLOCKS * args.check_prompts) * bb + 64 * MIB
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-pd-"))
    try:
        for cfg in cfgs:
            run = run_one(CONFIGS[cfg], wl, "full", args, model, work, bb, host_bytes=host)
            run["config"] = cfg
            report["runs"].append(run)
            _save(report, args.out)
        print_table(report)
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

"""vLLM's own benchmark client (``vllm.benchmarks.serve``) against a running server, and the server's
Prometheus counters around it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from _serving_workloads import Workload

# vLLM's client as a program: the `vllm` console script of the CPU build does not start.
_CLIENT = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
           "from vllm.benchmarks.serve import add_cli_args, main; "
           "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
HASH_SEED = "0"  # the client seeds each hash id's tokens with hash(): same prompts in every run
COUNTERS = ("vllm:prompt_tokens", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
            "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits", "vllm:tierkv_hit_tokens",
            "vllm:generation_tokens", "vllm:num_preemptions", "vllm:tierkv_store_seconds",
            "vllm:tierkv_store_steps", "vllm:tierkv_async_loads", "vllm:tierkv_load_errors",
            "vllm:tierkv_store_skipped", "vllm:tierkv_load_seconds", "vllm:tierkv_load_steps",
            "vllm:tierkv_load_bytes", "vllm:tierkv_store_copy_seconds", "vllm:tierkv_store_offered",
            "vllm:tierkv_store_gated", "vllm:tierkv_store_idle", "vllm:tierkv_stored_tokens")


def scrape(url: str) -> dict[str, float]:
    """The server's counters in :data:`COUNTERS` (summed over labels; 0 when absent)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def run_client(url: str, model_dir: str, served_name: str, workload: Workload, trace: Path,
               result: Path, log: Path, extra_body: dict | None = None) -> dict:
    """Replay ``workload`` (written to ``trace``) with vLLM's client on its own clock; returns the
    client's result JSON with the counters' deltas under ``"counters"``. ``extra_body``: more fields of
    every request (a tenant's ``cache_salt``).

    Raises:
        RuntimeError: the client exited with an error (its log's tail says why).
    """
    workload.write(trace)
    argv = [sys.executable, "-c", _CLIENT, "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", model_dir, "--tokenizer", model_dir, "--served-model-name", served_name,
            "--dataset-name", "timed_trace", "--dataset-path", str(trace), "--num-prompts", str(len(workload.rows)),
            "--timed-trace-chunk-hash-size", str(workload.chunk_tokens),
            "--timed-trace-sec-multiplier", repr(workload.sec_multiplier), "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(result.parent), "--result-filename", result.name]
    if extra_body:
        argv += ["--extra-body", json.dumps(extra_body)]
    env = dict(os.environ, PYTHONHASHSEED=HASH_SEED, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    before = scrape(url)
    with open(log, "ab") as fh:
        rc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
    after = scrape(url)
    if rc != 0 or not result.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"vLLM's benchmark client failed (rc {rc}); log {log}:\n{tail}")
    out = json.loads(result.read_text())
    out["counters"] = {k: after[k] - before[k] for k in COUNTERS}
    return out

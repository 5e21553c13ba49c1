"""``make run``: tierkv's main job, vLLM serving with tierkv as its KV cache, end to end on the
embedded default config.

1. convert the demo model (SmolLM2-135M-Instruct) on first use;
2. start the daemon (``python -m tierkv serve --config tierkv/configs/default.toml``, data under
   ./.tierkv/) and wait until it answers;
3. start vLLM's OpenAI server (the CPU build) with ``TierKVConnector``, drive the scripted multi-turn
   chat through its HTTP API as a client would (``examples/demo_vllm.py``), restart vLLM half-way, and
   print per turn the prompt tokens, the tokens tierkv served (by tier), TTFT with tierkv against a
   recompute of the same prompt, and the reply; then the tier stats;
4. stop the daemon with SIGTERM (it flushes host blocks to disk) and check it exits 0.

A second run finds the first run's blocks on the disk tier. ``examples/demo.py --engine transformers``
runs the same chat through tierkv's own transformers loop.

    .venv/bin/python examples/mainjob.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]  # the repository: examples/mainjob.py -> ..
for _p in (str(ROOT / "tools"), str(ROOT)):  # the harness in tools/; tierkv from the checkout
    if _p not in sys.path:
        sys.path.insert(1, _p)
from _conversation import TURNS  # noqa: E402
from _daemon_process import start_daemon, stop_daemon, tail  # noqa: E402
from _demo_model import cache_dir, ensure_converted, is_converted  # noqa: E402
from demo import format_tier_stats  # noqa: E402
from demo_vllm import format_vllm_turn, run_vllm_chat  # noqa: E402

from tierkv.client.admin import request  # noqa: E402
from tierkv.daemon.config import load_config  # noqa: E402

CONFIG = ROOT / "tierkv" / "configs" / "default.toml"  # the embedded default (package data)


def main() -> int:
    """Run the main job; returns the process exit status."""
    config = CONFIG if CONFIG.is_file() else None
    cfg = load_config(config)
    data_dir = ROOT / cfg.server.data_dir
    echo = click.echo
    echo("tierkv main job: vLLM serves a multi-turn chat (SmolLM2-135M-Instruct, CPU) with tierkv as its KV cache")
    echo(f"  model cache: {cache_dir()}{'' if is_converted() else ' (converting now, once)'}")
    model_dir = ensure_converted(out=sys.stdout)
    log_path = data_dir / "daemon.log"
    socket = cfg.socket_path
    proc = start_daemon(["--config", str(config)] if config else [], socket, log_path)
    echo(f"  daemon pid {proc.pid} ready on {socket} (config {config or 'built-in defaults'}, "
         f"data {data_dir}, log {log_path})")
    ok = True
    try:
        reports = run_vllm_chat(str(model_dir), socket, TURNS, data_dir, on_turn=lambda r: echo(format_vllm_turn(r)),
                                on_event=lambda m: echo(f"  {m}\n"))
        echo(format_tier_stats(request(socket, "STATS")))
        later = [r for r in reports if sum(r.tierkv_tokens.values())]
        if later:
            speed = statistics.median(r.speedup for r in later)
            echo(f"\nturns served from tierkv: {len(later)} of {len(reports)}; median TTFT {speed:.1f}x faster than "
                 f"recomputing; {sum(sum(r.tierkv_tokens.values()) for r in reports)} of "
                 f"{sum(r.prompt_tokens for r in reports)} prompt tokens came from tierkv")
        if not all(r.same_reply for r in reports):
            echo("some replies differ from recompute", err=True)
            ok = False
    except RuntimeError as exc:
        echo(f"vLLM failed: {exc}", err=True)
        ok = False
    finally:
        rc = stop_daemon(proc)
        echo(f"daemon stopped with exit status {rc}" + ("" if rc == 0 else f":\n{tail(log_path)}"))
    return 0 if ok and rc == 0 else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)

"""``make run``: tierkv's main job, vLLM serving with tierkv as its KV cache, end to end on the
embedded default config.

1. convert the demo model (SmolLM2-135M-Instruct) on first use;
2. start the daemon (``python -m tierkv serve --config configs/default.toml``, data under ./.tierkv/)
   and wait until it answers;
3. start vLLM's OpenAI server (the CPU build) with ``TierKVConnector``, drive the scripted multi-turn
   chat through its HTTP API as a client would (:mod:`tierkv.ops.demo_vllm`), restart vLLM half-way, and
   print per turn the prompt tokens, the tokens tierkv served (by tier), TTFT with tierkv against a
   recompute of the same prompt, and the reply; then the tier stats;
4. stop the daemon with SIGTERM (it flushes host blocks to disk) and check it exits 0.

A second run finds the first run's blocks on the disk tier. ``tierkv demo --engine transformers``
runs the same chat through tierkv's own transformers loop.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click

from tierkv.core.errors import ConnectionFailed
from tierkv.daemon.config import load_config

ROOT = Path(__file__).resolve().parents[2]  # the repository: tierkv/ops/mainjob.py -> ../..
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.toml"  # package data
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 120.0


def _ping(socket: str) -> bool:
    from tierkv.client.admin import request

    try:
        request(socket, "PING")
        return True
    except ConnectionFailed:
        return False


def start_daemon(serve_args: list[str], socket: str, log_path: Path,
                 timeout: float = READY_TIMEOUT_S) -> subprocess.Popen:
    """Start ``python -m tierkv serve SERVE_ARGS`` in the background and wait until it answers on
    ``socket``; its output goes to ``log_path``.

    Raises:
        click.ClickException: a daemon already answers there, or this one exited or never answered.
    """
    if _ping(socket):
        raise click.ClickException(f"a tierkv daemon already answers at {socket}; stop it first "
                                   "(or run `tierkv demo` against it)")
    cmd = [sys.executable, "-m", "tierkv", "serve", *serve_args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise click.ClickException(f"the daemon exited with {proc.returncode}:\n{_tail(log_path)}")
        if os.path.exists(socket) and _ping(socket):
            return proc
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise click.ClickException(f"the daemon did not answer within {timeout:.0f} s:\n{_tail(log_path)}")


def stop_daemon(proc: subprocess.Popen) -> int:
    """SIGTERM and wait; the exit status (killed after :data:`STOP_TIMEOUT_S`)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return -signal.SIGKILL


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


def main() -> int:
    """Run the main job; returns the process exit status."""
    from tierkv.integrations.model import cache_dir, ensure_converted, is_converted
    from tierkv.ops.conversation import TURNS
    from tierkv.ops.demo import format_tier_stats
    from tierkv.ops.demo_vllm import format_vllm_turn, run_vllm_chat

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
        from tierkv.client.admin import request

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
        echo(f"daemon stopped with exit status {rc}" + ("" if rc == 0 else f":\n{_tail(log_path)}"))
    return 0 if ok and rc == 0 else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)

"""A tierkv daemon as a child process: ``python -m tierkv serve ARGS``, started and waited for until it
answers, stopped with SIGTERM (it flushes host blocks to disk). Used by ``examples/mainjob.py`` (``make
run``), ``tools/bench_ttft.py`` and the transformers tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import click

from tierkv.core.errors import ConnectionFailed

ROOT = Path(__file__).resolve().parents[1]  # the repository: tools/_daemon_process.py -> ..
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
                                   "(or run examples/demo.py against it)")
    cmd = [sys.executable, "-m", "tierkv", "serve", *serve_args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise click.ClickException(f"the daemon exited with {proc.returncode}:\n{tail(log_path)}")
        if os.path.exists(socket) and _ping(socket):
            return proc
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise click.ClickException(f"the daemon did not answer within {timeout:.0f} s:\n{tail(log_path)}")


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


def tail(path: Path, n: int = 3000) -> str:
    """The last ``n`` characters of the log at ``path``."""
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"

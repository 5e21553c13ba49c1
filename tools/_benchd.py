"""The benchmarks' daemon: a `tierkv serve` subprocess started on a socket and stopped with SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import tierkv

_PROBE = tierkv.Layout(num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=16, dtype="bfloat16")


class Daemon:
    """`tierkv serve --socket SOCK --data-dir DATA_DIR ARGS` with warnings-only logs (stderr kept for the
    error of a daemon that exits at start)."""

    def __init__(self, data_dir: Path, sock: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.cmd = [sys.executable, "-m", "tierkv", "serve", "--socket", sock, "--data-dir", str(data_dir),
                    "--log-level", "warning", *args]
        self.sock = sock
        self.env = dict(os.environ, **(env or {}))
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> Daemon:
        self.proc = subprocess.Popen(self.cmd, stderr=subprocess.PIPE, env=self.env)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(self.proc.stderr.read().decode())  # type: ignore[union-attr]
            try:
                tierkv.Client.connect(self.sock, model="probe", layout=_PROBE, populate=False).close()
                return self
            except tierkv.TierKVError:
                time.sleep(0.1)
        raise RuntimeError("daemon did not start")

    def stop(self, timeout: float = 300.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout)

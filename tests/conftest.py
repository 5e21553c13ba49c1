"""Shared fixtures: a real daemon process on a temporary socket and data dir."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import tierkv
from tierkv.core.errors import ConnectionFailed

REPO = Path(__file__).resolve().parents[1]


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not has_cuda():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


class Daemon:
    """A `tierkv serve` subprocess; restartable on the same data dir."""

    sockdirs: list[Path] = []  # every socket dir made, removed at the end of the session

    def __init__(self, workdir: Path, args: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        # Unix socket paths are limited to ~107 bytes: keep them short.
        self.sockdir = Path(tempfile.mkdtemp(prefix="tkv-", dir="/tmp"))
        Daemon.sockdirs.append(self.sockdir)
        os.chmod(self.sockdir, 0o700)
        self.socket = str(self.sockdir / "s")
        self.data_dir = str(workdir / "data")
        self.args = list(args or [])
        self.env = dict(os.environ, **(env or {}))
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc: subprocess.Popen | None = None
        self.log = workdir / "daemon.log"

    def start(self, extra: list[str] | None = None, wait: bool = True) -> Daemon:
        cmd = [sys.executable, "-m", "tierkv", "serve", "--socket", self.socket, "--data-dir", self.data_dir,
               "--host-capacity", "256MiB", "--disk-capacity", "1GiB", "--slab-bytes", "8MiB",
               *self.args, *(extra or [])]
        self._logf = open(self.log, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._logf, stderr=subprocess.STDOUT, env=self.env, cwd=REPO)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            if os.path.exists(self.socket):
                try:
                    from tierkv.ops.cli import _request

                    _request(self.socket, "PING")
                    return
                except ConnectionFailed:
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"daemon not ready after {timeout}s:\n{self.log.read_text()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.proc = None
        self._logf.close()
        return rc

    def kill(self) -> None:
        self.stop(signal.SIGKILL)
        try:
            os.unlink(self.socket)  # a killed daemon leaves its socket file behind
        except FileNotFoundError:
            pass

    def restart(self, extra: list[str] | None = None) -> Daemon:
        self.stop()
        return self.start(extra)

    def client(self, model: str = "test-model", layout: tierkv.Layout | None = None, **kw) -> tierkv.Client:
        return tierkv.Client.connect(self.socket, model=model, layout=layout or SMALL, **kw)

    def stats(self) -> dict:
        from tierkv.ops.cli import _request

        return _request(self.socket, "STATS")


# A small layout keeps tests fast: 2 layers x 2 heads x 16 tokens x 32 dims, bf16 -> 8 KiB a block.
SMALL = tierkv.Layout(num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=16, dtype="bfloat16")


@pytest.fixture(scope="session", autouse=True)
def _remove_socket_dirs():
    yield
    for d in Daemon.sockdirs:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon_factory(tmp_path: Path):
    made: list[Daemon] = []

    def make(args: list[str] | None = None, start: bool = True, **kw) -> Daemon:
        d = Daemon(tmp_path / f"d{len(made)}", args, **kw)
        d.workdir.mkdir(parents=True, exist_ok=True)
        made.append(d)
        return d.start() if start else d

    yield make
    for d in made:
        d.stop()
        shutil.rmtree(d.sockdir, ignore_errors=True)


@pytest.fixture
def daemon(daemon_factory) -> Daemon:
    """A running daemon (256 MiB host, 1 GiB disk, 8 MiB slabs) on a temporary socket and data dir."""
    return daemon_factory()

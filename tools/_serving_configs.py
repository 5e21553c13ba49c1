"""The serving benchmark's configurations: vLLM alone, vLLM + tierkv, vLLM + LMCache (MP mode), and
prefill/decode disaggregation through tierkv (``pd``).

Each is a context manager that starts its processes (vLLM's OpenAI server; tierkv's daemon or
``lmcache server`` beside it) with a host tier of ``host_bytes`` and a disk tier under ``work``, and
yields the running :class:`_vllm_server.VllmServer`. vLLM's own KV cache is
``vllm_blocks`` blocks in every configuration (in each instance), with its prefix cache on. ``pd``
runs a prefill vLLM (connector ``kv_role`` ``kv_producer``) and a decode vLLM (``kv_consumer``) on one
daemon behind ``python -m tierkv pd-proxy``, and yields a :class:`Proxied` server: the proxy, spoken to
as one vLLM server (its ``/metrics`` are the decode's).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from _benchd import Daemon
from _vllm_server import VllmServer, connector_config, free_port

NAMES = ("vllm", "tierkv", "lmcache", "pd")
MAX_MODEL_LEN = 8192  # SmolLM2's context
MIB = 1 << 20
LMCACHE_CHUNK = 256


def max_request_len(vllm_blocks: int) -> int:
    """The most tokens (prompt + output) a request may have so that vLLM's own cache of ``vllm_blocks``
    128-token blocks holds it with a block to spare (vLLM refuses a request its cache cannot hold)."""
    return min(MAX_MODEL_LEN, (vllm_blocks - 1) * 128)


@dataclass
class CappedServer(VllmServer):
    """:class:`VllmServer` with ``--max-model-len`` at most the model's context, and optionally another
    venv's Python (LMCache runs in its own)."""

    python: str | None = None

    def command(self) -> list[str]:
        """The server's command line."""
        cmd = super().command()
        i = cmd.index("--max-model-len") + 1
        cmd[i] = str(min(int(cmd[i]), MAX_MODEL_LEN))
        if self.python:
            cmd[0] = self.python
        return cmd


@dataclass
class Proxied(VllmServer):
    """The pd-proxy at ``port`` in front of ``prefill`` and ``decode``, with VllmServer's client calls."""

    prefill: VllmServer | None = None
    decode: VllmServer | None = None


def lmcache_venv() -> Path:
    """LMCache's venv: ``$LMCACHE_VENV``, else ``.venv-lmcache`` in the repo root (tools/lmcache_env.sh)."""
    return Path(os.environ.get("LMCACHE_VENV") or Path(__file__).resolve().parents[1] / ".venv-lmcache")


def _wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"lmcache server exited (rc {proc.returncode}); log {log}:\n"
                               + "\n".join(log.read_text(errors="replace").splitlines()[-20:]))
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.5)
    raise RuntimeError(f"lmcache server did not listen on {port} within {timeout:.0f} s; log {log}")


@contextlib.contextmanager
def _vllm(server: VllmServer) -> Iterator[VllmServer]:
    server.start()
    try:
        server.chat([{"role": "user", "content": "warm up"}], max_tokens=2)
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def start(name: str, model_dir: str, work: Path, *, host_bytes: int, disk_bytes: int,
          vllm_blocks: int, tierkv_extra: dict | None = None) -> Iterator[VllmServer]:
    """Run configuration ``name`` (one of :data:`NAMES`) until the block exits; ``tierkv_extra``: more
    ``kv_connector_extra_config`` for tierkv's connector."""
    work.mkdir(parents=True, exist_ok=True)
    common = dict(log_path=work / "vllm.log", num_blocks=vllm_blocks)
    if name == "vllm":
        with _vllm(CappedServer(model_dir, None, **common)) as s:
            yield s
    elif name == "tierkv":
        kv = connector_config(None)
        with _daemon(work, host_bytes, disk_bytes) as sock:
            kv["kv_connector_extra_config"] = {"socket": sock, **(tierkv_extra or {})}
            with _vllm(CappedServer(model_dir, None, connector=kv, **common)) as s:
                yield s
    elif name == "pd":
        with _daemon(work, host_bytes, disk_bytes) as sock, _pd(model_dir, sock, work, vllm_blocks) as s:
            yield s
    elif name == "lmcache":
        with _lmcache(model_dir, work, host_bytes, common) as s:
            yield s
    else:
        raise ValueError(f"unknown configuration {name!r} (one of {', '.join(NAMES)})")


@contextlib.contextmanager
def _daemon(work: Path, host_bytes: int, disk_bytes: int) -> Iterator[str]:
    """tierkv's daemon with the given tiers under ``work``; yields its socket."""
    sock = str(work / "tierkv.sock")
    daemon = Daemon(work / "tierkv-data", sock, ["--host-capacity", f"{max(1, host_bytes // MIB)}MiB",
                                                 "--disk-capacity", f"{max(1, disk_bytes // MIB)}MiB"]).start()
    try:
        yield sock
        stats = subprocess.run([sys.executable, "-m", "tierkv", "stats", "--socket", sock, "--json"],
                               capture_output=True, text=True, timeout=60)
        (work / "tierkv-stats.json").write_text(stats.stdout or stats.stderr)  # the daemon's view of the run
    finally:
        daemon.stop()


@contextlib.contextmanager
def _pd(model_dir: str, sock: str, work: Path, vllm_blocks: int) -> Iterator[Proxied]:
    """A prefill and a decode vLLM on the daemon at ``sock``, and ``tierkv pd-proxy`` in front of them."""
    def server(role: str, log: str) -> CappedServer:
        return CappedServer(model_dir, None, work / log, num_blocks=vllm_blocks,
                            connector={**connector_config(sock), "kv_role": role})

    with _vllm(server("kv_producer", "vllm-prefill.log")) as prefill, \
            _vllm(server("kv_consumer", "vllm-decode.log")) as decode:
        port, log = free_port(), work / "pd-proxy.log"
        with open(log, "ab") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "tierkv", "pd-proxy", "--prefill", prefill.url,
                                     "--decode", decode.url, "--port", str(port)], stdout=fh,
                                    stderr=subprocess.STDOUT)
        try:
            proxied = Proxied(model_dir, None, log, port=port, name=decode.name, prefill=prefill, decode=decode)
            _wait_health(proxied.url, proc, log)
            yield proxied
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def _wait_health(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pd-proxy exited (rc {proc.returncode}); log {log}:\n{log.read_text(errors='replace')}")
        with contextlib.suppress(urllib.error.URLError, OSError), urllib.request.urlopen(url + "/health", timeout=15):
            return
        time.sleep(0.2)
    raise RuntimeError(f"pd-proxy did not report both instances healthy within {timeout:.0f} s; log {log}")


@contextlib.contextmanager
def _lmcache(model_dir: str, work: Path, host_bytes: int, common: dict) -> Iterator[VllmServer]:
    """``lmcache server`` (L1 of ``host_bytes`` in host memory, LRU; an ``fs`` L2 under ``work``) and
    vLLM's server with ``LMCacheMPConnector``, both from LMCache's venv."""
    venv = lmcache_venv()
    if not (venv / "bin" / "lmcache").exists():
        raise RuntimeError(f"LMCache's venv is missing at {venv}: run tools/lmcache_env.sh (or set LMCACHE_VENV)")
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false", NO_GPU_EXT="1", LMCACHE_DISABLE_BANNER="1",
               LMCACHE_MP_TRANSFER_MODE="engine_driven", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    env.pop("PYTHONPATH", None)
    port, http_port = free_port(), free_port()
    (work / "lmcache-l2").mkdir(parents=True, exist_ok=True)
    cmd = [str(venv / "bin" / "lmcache"), "server", "--host", "127.0.0.1", "--port", str(port),
           "--http-host", "127.0.0.1", "--http-port", str(http_port), "--chunk-size", str(LMCACHE_CHUNK),
           "--max-workers", "2", "--l1-size-gb", f"{host_bytes / 2**30:.3f}", "--eviction-policy", "LRU",
           "--supported-transfer-mode", "engine_driven",
           "--l2-adapter", json.dumps({"type": "fs", "base_path": str(work / "lmcache-l2")})]
    log = work / "lmcache.log"
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_port(port, proc, log)
        kv = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port,
                                            "lmcache.mp.mp_transfer_mode": "engine_driven"}}
        server = CappedServer(model_dir, None, connector=kv, python=str(venv / "bin" / "python"),
                              env={**{k: env[k] for k in ("LMCACHE_TRACK_USAGE", "NO_GPU_EXT", "LMCACHE_DISABLE_BANNER",
                                                          "LMCACHE_MP_TRANSFER_MODE", "VLLM_CPU_NUM_OF_RESERVED_CPU")},
                                   "PYTHONPATH": ""},
                              **common)
        with _vllm(server) as s:
            yield s
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)

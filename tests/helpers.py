"""Helpers shared by the test modules: the daemon process, layouts, keys and blocks, raw frames, waits."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import tierkv
from tierkv.core import protocol
from tierkv.core.errors import ConnectionFailed
from tierkv.core.keys import Namespace
from tierkv.core.layout import Layout
from tierkv.core.protocol import Op
from tierkv.daemon.malloc import TUNABLES

REPO = Path(__file__).resolve().parents[1]


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


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
        # set up front, the allocator tunables spare each start the daemon's re-exec that sets them
        # (tests/system/test_daemon.py starts one without them)
        self.env.setdefault("GLIBC_TUNABLES", TUNABLES)
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
                    from tierkv.client.admin import request

                    request(self.socket, "PING")
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

    def kill(self, unlink: bool = True) -> None:
        """SIGKILL; ``unlink`` removes the socket file it leaves behind (False: the next start must)."""
        self.stop(signal.SIGKILL)
        if not unlink:
            return
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
        from tierkv.client.admin import request

        return request(self.socket, "STATS")


# A small layout keeps tests fast: 2 layers x 2 heads x 16 tokens x 32 dims, bf16 -> 8 KiB a block.
SMALL = tierkv.Layout(num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=16, dtype="bfloat16")


def rand_blocks(n: int, layout: tierkv.Layout = SMALL, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.batch_shape(n), generator=g).to(layout.torch_dtype)


def keys_for(c: tierkv.Client, n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return c.block_keys(rng.integers(0, 50000, n * c.layout.block_tokens))


# The daemon re-execs itself once to set these glibc tunables; setting them up front skips that
# (a second torch import) and keeps the allocator exactly as in production.
FAST_ENV = {"GLIBC_TUNABLES": TUNABLES}


MAX_FRAME = 16 << 20  # the daemon's default server.max_frame_bytes


class RawClient:
    """One protocol connection driven by hand: frames go out exactly as given."""

    def __init__(self, path: str, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.rid = 0
        self.pool_fd: int | None = None

    def send(self, op: int, body: Any = None, rid: int | None = None) -> int:
        if rid is None:
            self.rid += 1
            rid = self.rid
        self.sock.sendall(protocol.pack(op, rid, body if body is not None else {}))
        return rid

    def recv(self) -> tuple[int, int, int, Any]:
        return protocol.recv_frame(self.sock, 1 << 30)

    def call(self, op: int, body: Any = None) -> tuple[int, Any]:
        """Send one request; return (status, body) of its reply."""
        rid = self.send(op, body)
        rop, status, rrid, reply = self.recv()
        assert (rop, rrid) == (int(op), rid), "reply does not echo the request"
        return status, reply

    def ok(self, op: int, body: Any = None) -> Any:
        status, reply = self.call(op, body)
        assert status == protocol.STATUS_OK, reply
        return reply

    def hello(self, ns: Namespace | dict, keep_fd: bool = False) -> tuple[int, Any]:
        """HELLO with a namespace; the pool memfd is closed unless ``keep_fd``."""
        body = ns.to_dict() if isinstance(ns, Namespace) else ns
        self.rid += 1
        self.sock.sendall(protocol.pack(Op.HELLO, self.rid, {"namespace": body}))
        _op, status, _rid, reply, fds = protocol.recv_frame_with_fds(self.sock, 1 << 30)
        for fd in fds:
            if keep_fd and self.pool_fd is None:
                self.pool_fd = fd
            else:
                os.close(fd)
        return status, reply

    def read_to_eof(self, limit: int = 1 << 20) -> bytes:
        """Everything the daemon sends until it closes the connection (raises on timeout)."""
        out = bytearray()
        while len(out) < limit:
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
        return bytes(out)

    def close(self) -> None:
        if self.pool_fd is not None:
            os.close(self.pool_fd)
            self.pool_fd = None
        self.sock.close()


def proc_sample(pid: int) -> dict[str, int]:
    """Leak-relevant figures of a process from /proc: fds, mappings, threads, RSS and anonymous RSS (kB)."""
    out = {"fds": len(os.listdir(f"/proc/{pid}/fd")),
           "maps": sum(1 for _ in open(f"/proc/{pid}/maps"))}
    for line in open(f"/proc/{pid}/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "Threads"):
            out[{"VmRSS": "rss_kb", "RssAnon": "anon_kb", "Threads": "threads"}[key]] = int(value.split()[0])
    return out


def quiet_sample(pid: int, polls: int = 3, step: float = 0.05, timeout: float = 10.0) -> dict[str, int]:
    """``proc_sample`` once fds and threads hold still for ``polls`` polls (a connection thread that has
    answered its last request may still be closing its socket)."""
    deadline = time.monotonic() + timeout
    last, same = proc_sample(pid), 0
    while same < polls and time.monotonic() < deadline:
        time.sleep(step)
        now = proc_sample(pid)
        same = same + 1 if (now["fds"], now["threads"]) == (last["fds"], last["threads"]) else 0
        last = now
    return last


def shm_held_by(pid: int) -> set[str]:
    """The /dev/shm entries process ``pid`` maps or holds open (the daemon shares memory through memfds,
    so it holds none; other tests' vLLM servers, beside it under pytest-xdist, hold theirs)."""
    held: set[str] = set()
    try:
        with open(f"/proc/{pid}/maps") as maps:
            held |= {line.split("/dev/shm/", 1)[1].split(" ")[0].strip() for line in maps if "/dev/shm/" in line}
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return held  # the process is gone
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("/dev/shm/"):
            held.add(target[len("/dev/shm/"):])
    return held


def settled_stats(c: tierkv.Client, polls: int = 3, step: float = 0.1, timeout: float = 30.0) -> dict:
    """``c.stats()`` once the daemon's background work has ended: each tier's blocks, evictions and
    bytes in and the transfers in flight hold still for ``polls`` polls (the evictor goes on freeing host
    memory, and write-behind goes on writing, after the request that started them was answered)."""
    def shape(st: dict) -> tuple:
        tiers = st["tiers"]
        return tuple((t, tiers[t].get("blocks"), tiers[t].get("evictions"), tiers[t].get("bytes_in"))
                     for t in sorted(tiers) if isinstance(tiers[t], dict)) + (st.get("transfer", {}).get("inflight"),)
    deadline = time.monotonic() + timeout
    last, same = c.stats(), 0
    while same < polls and time.monotonic() < deadline:
        time.sleep(step)
        now = c.stats()
        same = same + 1 if shape(now) == shape(last) else 0
        last = now
    return last


def block_values(keys: list[bytes], layout: Layout = SMALL) -> np.ndarray:
    """Block contents derived from each key (an oracle needs no memory of what was written)."""
    n = layout.block_bytes // 2
    out = np.empty((len(keys), n), np.uint16)
    for i, k in enumerate(keys):
        out[i] = np.random.default_rng(int.from_bytes(k[:8], "little")).integers(0, 1 << 16, n, np.uint16)
    return out.reshape(layout.batch_shape(len(keys)))


def as_earlier_format(blob: bytes, version: int = 1) -> bytes:
    """``blob`` as an earlier tierkv (format 1 or 2: no frame hash) wrote it, its header hash made to match."""
    import xxhash

    from tierkv.codecs import read_header
    from tierkv.codecs.container import _FRAME_HASH, _HASH

    end = read_header(blob).header_len - _HASH.size
    old = bytearray(blob[:end - _FRAME_HASH.size])
    old[4] = version
    return bytes(old) + _HASH.pack(xxhash.xxh3_64_intdigest(bytes(old))) + bytes(blob[end + _HASH.size:])


def wait_for(pred, timeout: float = 15.0, step: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())


def _send_and_close(path: str, frame: bytes) -> bytes:
    """Send a frame, half-close, and read whatever comes back until the daemon closes."""
    c = RawClient(path)
    try:
        c.sock.sendall(frame)
        c.sock.shutdown(socket.SHUT_WR)
        return c.read_to_eof()
    finally:
        c.close()


PAGE = 512  # kv_bytes_per_token=1 below, so one 512-token page is 512 bytes


def line(ts_ms, n_in, ids, n_out=1):
    return json.dumps({"timestamp": ts_ms, "input_length": n_in, "output_length": n_out, "hash_ids": ids})


class FakeClock:
    """A clock the test moves by hand (``clock.now += dt``)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def build_policy(name: str, clock: FakeClock | None = None, future: dict | None = None, **settings: Any):
    """A registered policy on a fake clock; ``opt`` reads next uses from ``future`` (default: never)."""
    from tierkv.cache.policy import make_policy

    clock = clock or FakeClock()
    if name == "opt":
        future = future if future is not None else {}
        return make_policy(name, clock=clock, next_use=lambda k: future.get(k, float("inf")), **settings)
    return make_policy(name, clock=clock, **settings)


_TYPE_CHECK: list[subprocess.Popen] = []


def start_type_check() -> None:
    """Start mypy on the package in the background (nice 10): :func:`type_check` waits for its result."""
    if not _TYPE_CHECK:
        _TYPE_CHECK.append(subprocess.Popen([sys.executable, "-m", "mypy"], cwd=REPO, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True, preexec_fn=lambda: os.nice(10)))


TYPE_CHECK_ENV = "TIERKV_TESTS_TYPE_CHECK"  # names the file of the session's mypy run (workers inherit it)


def start_shared_type_check(path: Path) -> None:
    """Start mypy in the background (nice 10) writing its output to ``path`` and then its exit status to
    ``path`` + ``.rc``, for :func:`type_check` in another process (a pytest-xdist worker) to read."""
    os.environ[TYPE_CHECK_ENV] = str(path)
    subprocess.Popen(["sh", "-c", f'"{sys.executable}" -m mypy > "{path}" 2>&1; echo $? > "{path}.rc.tmp"; '
                                  f'mv "{path}.rc.tmp" "{path}.rc"'],
                     cwd=REPO, preexec_fn=lambda: os.nice(10), start_new_session=True)


def type_check(timeout: float = 600.0) -> tuple[int, str]:
    """mypy's exit status and output: the run the session started (:func:`start_shared_type_check` or
    :func:`start_type_check`), else one started now."""
    shared = os.environ.get(TYPE_CHECK_ENV)
    if shared:
        rc = Path(f"{shared}.rc")
        deadline = time.monotonic() + timeout
        while not rc.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not rc.exists():
            return 1, f"the session's mypy run ({shared}) gave no result within {timeout:.0f} s"
        return int(rc.read_text()), Path(shared).read_text()
    start_type_check()
    proc = _TYPE_CHECK[0]
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


"""The daemon: accept loop, per-connection dispatch, lifecycle and signals (the handlers of each
request are in :mod:`tierkv.daemon.handlers`).

Lifecycle in the style of uvicorn: ``Config`` -> ``Server.serve()`` -> start-up (check paths, create the
pool, open LMDB, bind the socket) -> accept loop -> graceful shutdown on SIGTERM/SIGINT (stop accepting,
finish in-flight writes, flush, close LMDB, release shared memory, remove the socket); a second signal
forces exit.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import struct
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Protocol

from tierkv.cache.block import Session
from tierkv.core import protocol
from tierkv.core.errors import BadRequest, PermissionDenied, ProtocolError, TierKVError
from tierkv.core.protocol import Op
from tierkv.daemon.blockstore import BlockStore
from tierkv.daemon.config import Config
from tierkv.daemon.handlers import SENT, Handlers
from tierkv.daemon.samples import SampleRing

log = logging.getLogger("tierkv.daemon.server")


class Observer(Protocol):
    """What the dispatch loop uses of :class:`tierkv.daemon.metrics.Metrics` (imported only when served)."""

    def observe(self, op: int, seconds: float) -> None:
        """Record one request's latency."""

    def close(self) -> None:
        """Stop serving."""
_UCRED = struct.Struct("3i")


def check_private_dir(path: Path, create: bool = True) -> None:
    """Create ``path`` 0700 or verify an existing one: not a symlink, ours, not writable by others."""
    if path.is_symlink():
        raise PermissionDenied(f"{path} is a symlink; refusing to use it")
    if not path.exists():
        if not create:
            raise PermissionDenied(f"{path} does not exist")
        path.mkdir(mode=0o700, parents=True)
        os.chmod(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionDenied(f"{path} is not a directory")
    if st.st_uid != os.getuid():
        raise PermissionDenied(f"{path} belongs to uid {st.st_uid}, not to us ({os.getuid()})")
    if st.st_mode & 0o022:
        raise PermissionDenied(f"{path} is writable by group or others (mode {oct(st.st_mode & 0o777)})")


class Server:
    """One tierkv daemon."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.socket_path = Path(cfg.socket_path)
        self.data_dir = Path(cfg.server.data_dir)
        self.store: BlockStore | None = None
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self._conns: dict[int, tuple[socket.socket, Session]] = {}
        self._conn_lock = threading.Lock()
        self._session_ids = 0
        self._inflight = 0         # requests being served; guarded by _count_lock with `requests`
        self._count_lock = threading.Lock()
        self._signals = 0
        self.started = time.time()
        self.requests = 0
        self.metrics: Observer | None = None   # tierkv.daemon.metrics.Metrics while /metrics is served
        self.samples: SampleRing | None = None  # behind `tierkv stats --plot`
        self._pids: dict[int, int] = {}  # session id -> the client's pid (SO_PEERCRED)
        self._handlers = Handlers(self).by_opcode()

    # ---- lifecycle --------------------------------------------------------------------------------
    def serve(self) -> int:
        """Run until SIGTERM/SIGINT; returns the exit code."""
        self._install_signals()
        self.startup()
        try:
            self._accept_loop()
        finally:
            self.shutdown()
        return 0

    def startup(self) -> None:
        """Check paths, create tiers and bind the socket."""
        check_private_dir(self.data_dir)
        check_private_dir(self.socket_path.parent)
        self.store = BlockStore(self.cfg, str(self.data_dir))
        self._start_observers()  # before the socket: a bad metrics address leaves no socket behind
        if self.socket_path.exists() or self.socket_path.is_symlink():
            if not stat.S_ISSOCK(os.lstat(self.socket_path).st_mode):
                raise PermissionDenied(f"{self.socket_path} exists and is not a socket")
            if _socket_alive(self.socket_path):
                raise TierKVError(f"another daemon is listening on {self.socket_path}")
            self.socket_path.unlink()
        lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is created 0600: no window with wider permissions
        try:
            lst.bind(str(self.socket_path))
        finally:
            os.umask(old)
        lst.listen(128)
        lst.settimeout(0.2)
        self._listener = lst
        t = self.store
        log.info("tierkv ready: socket %s, host %d MiB, disk %s, %d blocks on disk", self.socket_path,
                 t.host.capacity >> 20, f"{t.disk.capacity >> 20} MiB" if t.disk else "off",
                 sum(1 for b in t.table.records() if b.on_disk))
        print(f"tierkv: ready on {self.socket_path}", file=sys.stderr, flush=True)

    def _start_observers(self) -> None:
        """The sample ring and, when ``server.metrics_addr`` is set, ``/metrics`` and the control API."""
        sc = self.cfg.server
        assert self.store is not None  # observers start after the store
        self.samples = SampleRing(self.store, sc.sample_interval_s, sc.sample_count)
        self.samples.start()
        if sc.metrics_addr:
            from tierkv.daemon.control import Control, read_token
            from tierkv.daemon.metrics import Metrics

            try:
                token = read_token(sc.control_token_file) if sc.control_token_file else None
            except ValueError as exc:
                raise TierKVError(str(exc)) from None
            metrics = Metrics(self, Control(self.store, token))
            host, port = metrics.serve(sc.metrics_addr)
            self.metrics = metrics
            print(f"tierkv: metrics on http://{host}:{port}/metrics", file=sys.stderr, flush=True)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    break
                log.warning("accept failed: %s", exc)
                time.sleep(0.05)
                continue
            threading.Thread(target=self._serve_conn, args=(conn,), daemon=True, name="tierkv-conn").start()

    def shutdown(self) -> None:
        """Drain and release everything; idempotent."""
        self._stop.set()
        if self.samples is not None:
            self.samples.stop()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            try:
                self.socket_path.unlink()
            except FileNotFoundError:
                pass
        deadline = time.monotonic() + self.cfg.server.drain_timeout_s
        while self._inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._conn_lock:
            conns = list(self._conns.values())
        for sock, _ in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self.store is not None:
            if self.cfg.server.flush_on_shutdown:
                n = self.store.evictor.flush(max(0.0, deadline - time.monotonic()))
                log.info("flushed %d blocks to disk", n)
            self.store.close(max(1.0, deadline - time.monotonic()))
            self.store = None
        log.info("tierkv stopped")

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, _frame: FrameType | None) -> None:
            self._signals += 1
            if self._signals > 1:
                os._exit(1)  # second signal: the operator wants out now
            log.info("signal %d: draining", signum)
            self._stop.set()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def request_stop(self) -> None:
        """Ask the accept loop to stop (as SIGTERM does)."""
        self._stop.set()

    # ---- connections ------------------------------------------------------------------------------
    def _peer_allowed(self, conn: socket.socket) -> bool:
        pid, uid, gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        if uid == os.getuid() or uid in self.cfg.server.allow_uids:
            return True
        log.warning("refused connection from pid %d uid %d", pid, uid)
        return False

    def _serve_conn(self, conn: socket.socket) -> None:
        # Credentials are checked before a single byte of the request is parsed.
        if not self._peer_allowed(conn) or len(self._conns) >= self.cfg.server.max_clients:
            conn.close()
            return
        with self._conn_lock:
            self._session_ids += 1
            session = Session(self._session_ids)
            self._conns[session.id] = (conn, session)
            self._pids[session.id] = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                   _UCRED.size))[0]
        reader = protocol.FrameReader(conn, self.cfg.server.max_frame_bytes)
        try:
            while not self._stop.is_set():
                try:
                    op, status, rid, body = reader.read()
                except ProtocolError as exc:
                    self._send_error(conn, 0, 0, exc)
                    return
                except (ConnectionError, OSError):
                    return
                if status != protocol.STATUS_OK:
                    self._send_error(conn, op, rid, ProtocolError("requests must carry status 0"))
                    return
                with self._count_lock:  # every connection thread counts: a read-modify-write each
                    self._inflight += 1
                    self.requests += 1
                t0 = time.perf_counter()
                try:
                    self._dispatch(conn, session, op, rid, body)
                finally:
                    with self._count_lock:
                        self._inflight -= 1
                    if self.metrics is not None:
                        self.metrics.observe(op, time.perf_counter() - t0)
        finally:
            with self._conn_lock:
                self._conns.pop(session.id, None)
                self._pids.pop(session.id, None)
            if self.store is not None:
                self.store.sessions.close(session)
            conn.close()

    def _dispatch(self, conn: socket.socket, s: Session, op: int, rid: int, body: object) -> None:
        try:
            entry = self._handlers.get(op)
            if entry is None:
                try:
                    name = Op(op).name
                except ValueError:
                    raise BadRequest(f"unknown opcode {op}") from None
                # a number the protocol reserves but this daemon does not serve
                raise BadRequest(f"opcode {name} is not supported by this daemon")
            op, handler = entry
            if body is None:
                body = {}
            elif type(body) is not dict:
                raise BadRequest("request body must be a map")
            s.rid = rid
            result = handler(conn, s, body)
        except TierKVError as exc:
            self._send_error(conn, op, rid, exc)
            return
        except Exception as exc:
            log.exception("request %s failed", op)
            self._send_error(conn, op, rid, TierKVError(f"internal error: {type(exc).__name__}: {exc}"))
            return
        if result is not SENT:
            conn.sendall(protocol.pack(op, rid, result))

    def _send_error(self, conn: socket.socket, op: int, rid: int, exc: TierKVError) -> None:
        try:
            conn.sendall(protocol.pack(int(op), rid, {"code": exc.code, "message": str(exc)}, protocol.STATUS_ERROR))
        except OSError:
            pass

    def stats(self) -> dict:
        """The snapshot behind ``tierkv stats``: the server's figures and the store's."""
        assert self.store is not None
        st = self.store.snapshots.store()
        with self.store.ctx.lock:
            gate = self.store.gate.snapshot()
        return {
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 3),
            "clients": len(self._conns),
            "leases": st["leases"],
            "requests": self.requests,
            "lookup_index": st["lookup_index"],
            "health": st["health"],
            "tiers": st["tiers"],
            "namespaces": st["namespaces"],
            "sessions": self._session_stats(),
            "transfer": st["transfer"],
            "events": st["events"],
            "store_gate": gate,
            "tenants": st["tenants"],
        }

    def memory_figures(self) -> dict[str, int]:
        """Sizes of the daemon's own structures, for ``TIERKV_MEMDEBUG`` samples: block records, policy
        entries per tier, use history, connections, threads, the LMDB file (empty before start-up)."""
        store = self.store
        if store is None:
            return {}
        with store.ctx.lock:
            out = {"blocks": len(store.table), "history": len(store.history), "host_policy": len(store.hostm.policy),
                   "disk_policy": len(store.diskm.policy)}
        with self._conn_lock:
            out["conns"] = len(self._conns)
        out["threads"] = threading.active_count()
        if store.disk is not None:
            out["lmdb_file_mb"] = store.disk.file_bytes() >> 20
        return out

    def _session_stats(self) -> list[dict]:
        """Per connection: its client's pid, model and what it holds leased."""
        with self._conn_lock:
            conns = list(self._conns.values())
        out = []
        for _, sess in conns:
            out.append({"session": sess.id, "pid": self._pids.get(sess.id, 0),
                        "model": sess.ns.model if sess.ns is not None else "",
                        "leases": len(sess.leases), "leased_blocks": sum(len(x.blocks) for x in sess.leases.values())})
        return out


def _socket_alive(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(0.5)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()

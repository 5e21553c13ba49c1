"""The daemon: accept loop, per-connection dispatch, lifecycle and signals.

Lifecycle in the style of uvicorn: ``Config`` -> ``Server.serve()`` -> start-up (check paths, create the
pool, open LMDB, bind the socket) -> accept loop -> graceful shutdown on SIGTERM/SIGINT (stop accepting,
finish in-flight writes, flush, close LMDB, release shared memory, remove the socket); a second signal
forces exit.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import stat
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tierkv.cache.table import BlockTable, Session, validate_keys
from tierkv.core import protocol
from tierkv.core.errors import BadRequest, PermissionDenied, ProtocolError, TierKVError
from tierkv.core.keys import Namespace
from tierkv.core.protocol import Op
from tierkv.daemon.config import Config
from tierkv.daemon.stats import tier_snapshot

log = logging.getLogger("tierkv.daemon.server")
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
        self.table: BlockTable | None = None
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
        self.metrics: Any = None   # tierkv.daemon.metrics.Metrics while /metrics is served
        self.samples: Any = None   # tierkv.daemon.samples.SampleRing behind `tierkv stats --plot`
        self._pids: dict[int, int] = {}  # session id -> the client's pid (SO_PEERCRED)
        # opcode -> (Op, bound handler), built once: no enum or attribute lookups per request
        self._handlers = {int(o): (o, getattr(self, f"_op_{o.name.lower()}"))
                          for o in Op if hasattr(self, f"_op_{o.name.lower()}")}

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
        self.table = BlockTable(self.cfg, str(self.data_dir))
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
        t = self.table
        log.info("tierkv ready: socket %s, host %d MiB, disk %s, %d blocks on disk", self.socket_path,
                 t.host.capacity >> 20, f"{t.disk.capacity >> 20} MiB" if t.disk else "off",
                 sum(1 for b in t.blocks.values() if b.on_disk))
        print(f"tierkv: ready on {self.socket_path}", file=sys.stderr, flush=True)

    def _start_observers(self) -> None:
        from tierkv.daemon.samples import SampleRing

        sc = self.cfg.server
        self.samples = SampleRing(self.table, sc.sample_interval_s, sc.sample_count)
        self.samples.start()
        if sc.metrics_addr:
            from tierkv.daemon.metrics import Metrics

            self.metrics = Metrics(self)
            host, port = self.metrics.serve(sc.metrics_addr)
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
        if self.table is not None:
            if self.cfg.server.flush_on_shutdown:
                n = self.table.flush(max(0.0, deadline - time.monotonic()))
                log.info("flushed %d blocks to disk", n)
            self.table.close(max(1.0, deadline - time.monotonic()))
            self.table = None
        log.info("tierkv stopped")

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, _frame: Any) -> None:
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
            if self.table is not None:
                self.table.close_session(session)
            conn.close()

    def _dispatch(self, conn: socket.socket, s: Session, op: int, rid: int, body: Any) -> None:
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
        if result is not _SENT:
            conn.sendall(protocol.pack(op, rid, result))

    def _send_error(self, conn: socket.socket, op: int, rid: int, exc: TierKVError) -> None:
        try:
            conn.sendall(protocol.pack(int(op), rid, {"code": exc.code, "message": str(exc)}, protocol.STATUS_ERROR))
        except OSError:
            pass

    # ---- operations -------------------------------------------------------------------------------
    def _op_ping(self, conn: socket.socket, s: Session, body: dict) -> dict:
        return {"pong": True, "pid": os.getpid(), "version": protocol.VERSION}

    def _op_hello(self, conn: socket.socket, s: Session, body: dict) -> Any:
        assert self.table is not None
        try:
            ns = Namespace.from_dict(body.get("namespace") or {})
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        self.table.register(s, ns)
        pool = self.table.host
        body = {"fingerprint": ns.fingerprint, "pool_bytes": pool.capacity, "session": s.id, "pid": os.getpid()}
        fds = [pool.fd]
        if self.table.gpu is not None:
            # CUDA: an IPC handle in the body; the CPU stand-in: a second memfd after the host pool's.
            body["gpu"], gpu_fds = self.table.gpu.export()
            fds += gpu_fds
        if self.table.index is not None:
            # The lookup index, last: clients answer lookups from it (the remote tier still needs us).
            body["lookup_index"] = {"remote": self.table.remote is not None}
            fds.append(self.table.index.fd)
        # The reply carries the pool's memfd (SCM_RIGHTS): no named shared memory exists to leak.
        socket.send_fds(conn, [protocol.pack(Op.HELLO, s.rid, body)], fds)
        return _SENT

    def _op_alloc(self, conn: socket.socket, s: Session, body: dict) -> dict:
        assert self.table is not None
        keys = body.get("keys")
        if keys is not None:
            keys = validate_keys(keys)
        n = body.get("n", len(keys) if keys is not None else 0)
        return {"slots": self.table.alloc(s, n, keys, body.get("tier", "host"))}

    def _op_commit(self, conn: socket.socket, s: Session, body: dict) -> dict:
        assert self.table is not None
        keys = validate_keys(body.get("keys"))
        slots = body.get("slots")
        if not isinstance(slots, list):
            raise BadRequest("slots must be a list")
        wait = body.get("wait", True)
        if type(wait) is not bool:
            raise BadRequest("wait must be a bool")
        return {"new": self.table.commit(s, keys, slots, bool(body.get("durable", False)), body.get("tier", "host"),
                                         wait)}

    def _op_sync(self, conn: socket.socket, s: Session, body: dict) -> dict:
        assert self.table is not None
        self.table.sync(s)
        return {}

    def _op_abort(self, conn: socket.socket, s: Session, body: dict) -> dict:
        assert self.table is not None
        slots = body.get("slots")
        if not isinstance(slots, list) or not all(type(x) is int for x in slots):
            raise BadRequest("slots must be a list of ints")
        self.table.abort(s, slots, body.get("tier", "host"))
        return {}

    def _op_lookup(self, conn: socket.socket, s: Session, body: dict) -> dict:
        assert self.table is not None
        keys = validate_keys(body.get("keys"))
        if not body.get("tiers"):
            return {"count": self.table.lookup_count(s, keys)}
        tiers = self.table.lookup(s, keys)
        return {"count": len(tiers), "tiers": tiers}

    def _op_acquire(self, conn: socket.socket, s: Session, body: dict) -> dict:
        assert self.table is not None
        lease, slots, tiers = self.table.acquire(s, validate_keys(body.get("keys")), body.get("tier", "host"))
        return {"lease": lease, "slots": slots, "tiers": tiers}

    def _op_fetch(self, conn: socket.socket, s: Session, body: dict) -> dict:
        assert self.table is not None
        return {"ticket": self.table.fetch(s, validate_keys(body.get("keys")), body.get("tier", "host"))}

    def _op_wait(self, conn: socket.socket, s: Session, body: dict) -> dict:
        assert self.table is not None
        timeout = body.get("timeout")
        if timeout is not None and (not isinstance(timeout, int | float) or timeout < 0):
            raise BadRequest("timeout must be a non-negative number or None")
        lease, slots, tiers = self.table.wait(s, body.get("ticket"), timeout)
        return {"lease": lease, "slots": slots, "tiers": tiers}

    def _op_prefetch(self, conn: socket.socket, s: Session, body: dict) -> dict:
        assert self.table is not None
        return {"started": self.table.prefetch(s, validate_keys(body.get("keys")), body.get("tier", "host"))}

    def _op_plan(self, conn: socket.socket, s: Session, body: dict) -> dict:
        assert self.table is not None
        return self.table.plan(s, validate_keys(body.get("keys")))

    def _op_recompute(self, conn: socket.socket, s: Session, body: dict) -> dict:
        assert self.table is not None
        tokens, seconds = body.get("tokens"), body.get("seconds")
        if not isinstance(tokens, int) or tokens <= 0 or not isinstance(seconds, int | float) or seconds <= 0:
            raise BadRequest("tokens must be a positive int and seconds a positive number")
        self.table.engine.cost.observe_recompute(tokens, float(seconds))
        return {"tokens_per_s": self.table.engine.cost.recompute_tokens_per_s()}

    def _op_release(self, conn: socket.socket, s: Session, body: dict) -> dict:
        assert self.table is not None
        leases = body.get("leases")
        if not isinstance(leases, list) or not all(isinstance(x, int) for x in leases):
            raise BadRequest("leases must be a list of ints")
        self.table.release(s, leases)
        return {}

    def _op_delete(self, conn: socket.socket, s: Session, body: dict) -> dict:
        assert self.table is not None
        return {"deleted": self.table.delete(s, validate_keys(body.get("keys")))}

    def _op_request_finished(self, conn: socket.socket, s: Session, body: dict) -> dict:
        return {"cached": self.table.request_finished(s, validate_keys(body.get("keys")))}

    def _op_touch(self, conn: socket.socket, s: Session, body: dict) -> dict:
        assert self.table is not None
        keys = validate_keys(body.get("keys"))
        scores = body.get("scores")
        if not isinstance(scores, list) or len(scores) != len(keys):
            raise BadRequest("scores must be a list as long as keys")
        try:
            scores = [float(x) for x in scores]
        except (TypeError, ValueError):
            raise BadRequest("scores must be numbers") from None
        if not all(math.isfinite(x) and x >= 0 for x in scores):
            raise BadRequest("scores must be finite numbers >= 0")  # checked before any block is touched
        return {"touched": self.table.touch(s, keys, scores)}

    def _op_stats(self, conn: socket.socket, s: Session, body: dict) -> dict:
        if body.get("samples"):  # the sample ring instead of the snapshot
            return self.samples.snapshot() if self.samples is not None else {"interval_s": 0, "samples": []}
        return self.stats()

    def _op_health(self, conn: socket.socket, s: Session, body: dict) -> dict:
        assert self.table is not None
        reason = self.table.degraded
        if self.table.remote is not None and self.table.remote.state()["state"] != "up":
            reason = reason or f"remote tier {self.table.remote.state()['state']}"
        return {"status": "degraded" if reason else "ok", "reason": reason}

    def _op_verify(self, conn: socket.socket, s: Session, body: dict) -> dict:
        assert self.table is not None
        return self.table.verify(bool(body.get("drop", False)))

    def _op_config(self, conn: socket.socket, s: Session, body: dict) -> dict:
        settings = self.cfg.to_dict()
        if settings["remote"].get("password"):
            settings["remote"]["password"] = "***"
        return {"settings": settings, "sources": dict(self.cfg.sources)}

    # Settings fixed at start-up (they shape the pool, the socket or the LMDB environment).
    _RESTART_ONLY = ("server.socket", "server.data_dir", "server.allow_uids", "server.max_frame_bytes",
                     "host.slab_bytes", "host.prefault", "disk.enabled", "disk.workers", "disk.sync",
                     "server.max_clients", "server.lookup_index_slots", "gpu.capacity", "gpu.device", "gpu.slab_bytes")
    _RESTART_ONLY += ("server.metrics_addr", "server.sample_interval_s", "server.sample_count")

    def _op_tune(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """Change settings on the running daemon: all are checked first; a bad one changes nothing."""
        import copy

        assert self.table is not None
        settings = body.get("settings")
        if not isinstance(settings, dict) or not settings:
            raise BadRequest("settings must be a non-empty map of KEY to VALUE")
        new = copy.deepcopy(self.cfg)
        try:
            for key, value in settings.items():
                if key in self._RESTART_ONLY:
                    raise ValueError(f"{key} is fixed at start-up; change it in the config and restart")
                new.set(key, value, "tune")
            new.validate()
            self.table.apply(new, set(settings))
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        self.cfg = new
        if "server.log_level" in settings:
            logging.getLogger().setLevel(new.server.log_level.upper())
        return {"applied": sorted(settings)}

    def _op_pin(self, conn: socket.socket, s: Session, body: dict) -> dict:
        assert self.table is not None
        return {"pinned": self.table.pin_prefix(s, validate_keys(body.get("keys")), body.get("priority", 80))}

    def _op_unpin(self, conn: socket.socket, s: Session, body: dict) -> dict:
        assert self.table is not None
        return {"unpinned": self.table.unpin(s, validate_keys(body.get("keys")))}

    def _op_window(self, conn: socket.socket, s: Session, body: dict) -> dict:
        assert self.table is not None
        args = [body.get(k) for k in ("budget", "sinks", "recent")]
        if not all(isinstance(a, int) for a in args):
            raise BadRequest("budget, sinks and recent must be ints")
        return {"demoted": self.table.window(s, validate_keys(body.get("keys")), *args)}

    def stats(self) -> dict:
        """The snapshot behind ``tierkv stats``."""
        t = self.table
        assert t is not None
        with t.lock:
            host_blocks = [b for b in t.blocks.values() if b.host_off is not None]
            live = sum(b.nbytes for b in host_blocks)
            disk_blocks = sum(1 for b in t.blocks.values() if b.on_disk)
            leases = sum(b.leases + b.gpu_leases for b in t.blocks.values())
            tiers = {
                "host": tier_snapshot(t.host_stats, capacity=t.host.capacity, used=t.host.used_bytes,
                                      blocks=len(host_blocks), fragmentation=round(t.host.fragmentation(live), 4),
                                      slabs={str(k): v for k, v in t.host.slab_usage().items()},
                                      policy=t.host_policy.name),
            }
            if t.gpu is not None:
                gpu_blocks = [b for b in t.blocks.values() if b.gpu_off is not None]
                gpu_live = sum(b.nbytes for b in gpu_blocks)
                tiers["gpu"] = tier_snapshot(t.gpu_stats, capacity=t.gpu.capacity, used=t.gpu.used_bytes,
                                             blocks=len(gpu_blocks), kind=t.gpu.kind, device=t.gpu.device,
                                             fragmentation=round(t.gpu.fragmentation(gpu_live), 4),
                                             draining=sum(1 for b in gpu_blocks if b.draining),
                                             host_pinned=bool(t.engine._registered), policy=t.gpu_policy.name)
                tiers["gpu"]["bytes_logical"] = gpu_live
                tiers["gpu"]["bytes_stored"] = t.gpu.used_bytes
                tiers = {"gpu": tiers["gpu"], "host": tiers["host"]}  # hottest tier first, as in lookup
            tiers["host"]["bytes_logical"] = live
            tiers["host"]["bytes_stored"] = t.host.used_bytes
            tiers["host"]["pinned_bytes"] = t.pinned_bytes
            tiers["host"]["limit_bytes"] = t.host_limit
            tiers["host"]["reuse"] = t.host_reuse.snapshot()
            if t.disk is not None:
                tiers["disk"] = tier_snapshot(t.disk_stats, capacity=t.disk.capacity, used=t.disk_used,
                                              blocks=disk_blocks, codec=t.engine.codec, file_bytes=t.disk.file_bytes(),
                                              readers=t.disk.readers(), policy=t.disk_policy.name,
                                              admission=t.cfg.disk.admission, admitted=t.placement.admitted,
                                              written_behind=t.written_behind,
                                              rejected=t.placement.rejected,
                                              placement=t.placement.snapshot())
        remote = t.remote_snapshot()  # may touch the network: outside the table lock
        if remote is not None:
            tiers["remote"] = remote
        with t.lock:
            namespaces = {ns.fingerprint.hex(): {"model": ns.model, "layout": ns.layout.to_dict(),
                                                 "tp_rank": ns.tp_rank, "blocks": t.ns_blocks.get(fp, 0),
                                                 "hits": t.ns_hits.get(fp, (0, 0))[0],
                                                 "misses": t.ns_hits.get(fp, (0, 0))[1]}
                          for fp, ns in t.namespaces.items()}
            sessions = self._session_stats()
            return {
                "pid": os.getpid(),
                "uptime_s": round(time.time() - self.started, 3),
                "clients": len(self._conns),
                "leases": leases,
                "requests": self.requests,
                # slots, keys, overflow (lookups answered by the daemon until it holds fewer blocks)
                "lookup_index": t.index.info() if t.index is not None else None,
                "health": "degraded" if t.degraded else "ok",
                "tiers": tiers,
                "namespaces": namespaces,
                "sessions": sessions,
                "transfer": {"inflight": t.engine.inflight, "bytes": dict(t.engine.link_bytes),
                             "seconds": {k: round(v, 4) for k, v in t.engine.link_seconds.items()},
                             "links": {k: v.to_dict() for k, v in t.engine.budgets.stats().items()},
                             "cost": t.engine.cost.snapshot()},
            }

    def _session_stats(self) -> list[dict]:
        """Per connection: its client's pid, model and what it holds leased (caller holds the table lock)."""
        with self._conn_lock:
            conns = list(self._conns.values())
        out = []
        for _, sess in conns:
            out.append({"session": sess.id, "pid": self._pids.get(sess.id, 0),
                        "model": sess.ns.model if sess.ns is not None else "",
                        "leases": len(sess.leases), "leased_blocks": sum(len(x.blocks) for x in sess.leases.values())})
        return out


_SENT = object()


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

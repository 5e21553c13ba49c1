"""Request handlers: one method per opcode, named after it. Each checks its request body, calls the
object of the block store that owns the request (a path, the sessions, retention, tuning, ...) and
returns the reply body (or :data:`SENT` when it replied itself)."""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Callable
from typing import Protocol

from tierkv.cache import tuning
from tierkv.cache.block import (
    MAX_TENANT,
    Session,
    validate_chains,
    validate_keys,
    validate_tenants,
    validate_tokens,
)
from tierkv.cache.clock import DrivenClock
from tierkv.core import protocol
from tierkv.core.errors import BadRequest
from tierkv.core.keys import Namespace
from tierkv.core.protocol import Op
from tierkv.daemon.blockstore import BlockStore
from tierkv.daemon.config import Config
from tierkv.daemon.gpupath import GpuPath
from tierkv.daemon.samples import SampleRing
from tierkv.daemon.sessions import namespace

SENT = object()  # a handler's result when it sent its reply itself (HELLO passes file descriptors)
Handler = Callable[[socket.socket, Session, dict], object]  # a reply body (packed as msgpack), or SENT


class Served(Protocol):
    """What the handlers use of their server (:class:`tierkv.daemon.server.Server`)."""

    cfg: Config  # replaced by TUNE
    store: BlockStore | None
    samples: SampleRing | None

    def stats(self) -> dict:
        """The snapshot behind ``tierkv stats``."""
        ...


class Handlers:
    """The handlers of one server; :meth:`by_opcode` maps each opcode to (Op, handler)."""

    def __init__(self, srv: Served) -> None:
        self.srv = srv

    @property
    def store(self) -> BlockStore:
        """The running server's block store."""
        assert self.srv.store is not None
        return self.srv.store

    def by_opcode(self) -> dict[int, tuple[Op, Handler]]:
        """opcode -> (Op, bound handler: the method named for it), built once: no enum or attribute lookups
        per request."""
        return {int(o): (o, getattr(self, o.name.lower())) for o in Op}

    def ping(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """Liveness: the daemon's pid and protocol version."""
        return {"pong": True, "pid": os.getpid(), "version": protocol.VERSION}

    def hello(self, conn: socket.socket, s: Session, body: dict) -> object:
        """Bind the connection to a namespace; the reply carries the pools' and the index's fds."""
        try:
            ns = Namespace.from_dict(body.get("namespace") or {})
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        self.store.sessions.register(s, ns)
        pool = self.store.host
        body = {"fingerprint": ns.fingerprint, "pool_bytes": pool.capacity, "session": s.id, "pid": os.getpid()}
        fds = [pool.fd]
        if self.store.gpu is not None:
            # CUDA: an IPC handle in the body; the CPU stand-in: a second memfd after the host pool's.
            body["gpu"], gpu_fds = self.store.gpu.export()
            fds += gpu_fds
        if self.store.table.index is not None:
            # The lookup index, last: clients answer lookups from it (the remote tier still needs us).
            body["lookup_index"] = {"remote": self.store.remote is not None}
            fds.append(self.store.table.index.fd)
        # The reply carries the pool's memfd (SCM_RIGHTS): no named shared memory exists to leak.
        socket.send_fds(conn, [protocol.pack(Op.HELLO, s.rid, body)], fds)
        return SENT

    def alloc(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """Slots for new blocks (None for keys already cached)."""
        keys = body.get("keys")
        if keys is not None:
            keys = validate_keys(keys)
        n = body.get("n", len(keys) if keys is not None else 0)
        timeout = body.get("timeout")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 <= timeout <= 3600):
            raise BadRequest(f"timeout must be seconds within 0..3600 or None, got {timeout!r}")
        keep = validate_keys(body.get("keep", []))
        st, ns = self.store, namespace(s)
        gpu = self._gpu(body)
        if gpu is not None:
            return {"slots": gpu.alloc(s, ns, n, keys)}
        return {"slots": st.store_path.alloc(s, ns, n, keys, timeout, keep)}

    def commit(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """Publish written slots under their keys."""
        keys = validate_keys(body.get("keys"))
        slots = body.get("slots")
        if not isinstance(slots, list):
            raise BadRequest("slots must be a list")
        st, ns = self.store, namespace(s)
        tokens = validate_tokens(body.get("tokens"), len(keys), ns.layout.block_tokens)
        tokens = tokens if st.events is not None else None
        durable, remote, uses = bool(body.get("durable", False)), _flag(body, "remote", False), \
            validate_keys(body.get("uses", []))
        gpu = self._gpu(body)
        if gpu is not None:
            return {"new": gpu.commit(s, ns, keys, slots, durable, remote, tokens, uses)}
        return {"new": st.store_path.commit(s, ns, keys, slots, durable, _flag(body, "wait", True),
                                            validate_chains(body.get("chains"), len(keys)), remote, tokens, uses,
                                            validate_tenants(body.get("tenants"), len(keys)))}

    def sync(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """Wait for this connection's queued durable writes."""
        self.store.store_path.sync(s)
        return {}

    def abort(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """Give back allocated slots unwritten."""
        slots = body.get("slots")
        if not isinstance(slots, list) or not all(type(x) is int for x in slots):
            raise BadRequest("slots must be a list of ints")
        gpu = self._gpu(body)
        if gpu is not None:
            gpu.abort(s, slots)
        else:
            self.store.store_path.abort(s, slots)
        return {}

    def lookup(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """How much of a prefix is cached (and, with ``tiers``, where)."""
        keys = validate_keys(body.get("keys"))
        namespace(s)  # a BadRequest before HELLO
        if not body.get("tiers"):
            return {"count": self.store.fetch_path.lookup_count(s, keys)}
        tiers = self.store.fetch_path.lookup(s.fp, keys)
        return {"count": len(tiers), "tiers": tiers}

    def acquire(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """Lease the cached prefix, waiting for promotions."""
        keys = validate_keys(body.get("keys"))
        ticket = self._fetch(s, keys, body)
        lease, slots, tiers = self.store.fetch_path.wait(s, ticket, None)
        return {"lease": lease, "slots": slots, "tiers": tiers}

    def fetch(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """Start leasing the cached prefix; a ticket for WAIT."""
        keys = validate_keys(body.get("keys"))
        return {"ticket": self._fetch(s, keys, body)}

    def _fetch(self, s: Session, keys: list[bytes], body: dict) -> int:
        """Start a fetch in the tier ``body`` names (a request's use of its prefix chain: the reuse
        models learn from it); its ticket."""
        ns, gpu = namespace(s), self._gpu(body)
        self.store.signals.requested(s, keys)
        return gpu.fetch(s, ns, keys) if gpu is not None else self.store.fetch_path.fetch(s, ns, keys)

    def _gpu(self, body: dict) -> GpuPath | None:
        """The GPU path when ``body`` names the GPU tier (None: the host tier).

        Raises:
            BadRequest: another tier name, or the GPU tier is off.
        """
        if self.store.slots.tier(body.get("tier", "host")) != "gpu":
            return None
        assert self.store.gpu_path is not None  # slots.tier checked that the GPU tier is on
        return self.store.gpu_path

    def wait(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """Turn a ticket into a lease on what arrived within the timeout."""
        timeout = body.get("timeout")
        if timeout is not None and (not isinstance(timeout, int | float) or timeout < 0):
            raise BadRequest("timeout must be a non-negative number or None")
        ticket = body.get("ticket")
        if not isinstance(ticket, int):
            raise BadRequest(f"ticket {ticket!r} is not pending on this connection")
        lease, slots, tiers = self.store.fetch_path.wait(s, ticket, timeout)
        return {"lease": lease, "slots": slots, "tiers": tiers}

    def prefetch(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """Warm the cached prefix in the background."""
        keys = validate_keys(body.get("keys"))
        ns, gpu = namespace(s), self._gpu(body)
        self.store.signals.requested(s, keys)
        return {"started": gpu.prefetch(s, ns, keys) if gpu is not None else self.store.fetch_path.prefetch(s, ns, keys)}

    def plan(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """Where the cached prefix is and how much is worth fetching."""
        keys = validate_keys(body.get("keys"))
        return self.store.fetch_path.plan(s, namespace(s), keys)

    def recompute(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """A measured recompute speed for the cost model."""
        tokens, seconds = body.get("tokens"), body.get("seconds")
        if not isinstance(tokens, int) or tokens <= 0 or not isinstance(seconds, int | float) or seconds <= 0:
            raise BadRequest("tokens must be a positive int and seconds a positive number")
        self.store.cost.observe_recompute(tokens, float(seconds))
        return {"tokens_per_s": self.store.cost.recompute_tokens_per_s()}

    def release(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """End leases."""
        leases = body.get("leases")
        if not isinstance(leases, list) or not all(isinstance(x, int) for x in leases):
            raise BadRequest("leases must be a list of ints")
        self.store.sessions.release(s, leases)
        return {}

    def delete(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """Drop blocks from every tier."""
        return {"deleted": self.store.retention.delete(s, validate_keys(body.get("keys")))}

    def request_finished(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """The engine finished a request: a chain its next turn may extend (``output_tokens``: how
        many tokens it generated, optional)."""
        keys = validate_keys(body.get("keys"))
        out = body.get("output_tokens")
        if out is not None and (isinstance(out, bool) or not isinstance(out, int) or out < 0):
            raise BadRequest(f"output_tokens must be an int >= 0 or absent, got {out!r}")
        return {"cached": self.store.signals.request_finished(s, keys, out)}

    def clock(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """Move the decisions' clock (``server.synchronous`` only)."""
        clock = self.store.ctx.clock
        if not isinstance(clock, DrivenClock):
            raise BadRequest("this daemon decides on the monotonic clock: start it with server.synchronous = true "
                             "to set its clock")
        with self.store.ctx.lock:
            try:
                clock.set(body.get("now"))
            except ValueError as e:
                raise BadRequest(str(e)) from None
        return {"now": clock.now}

    def offer(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """Requests' new blocks offered for storing: how many leading keys of each to store now, and how
        many if the engine is idle when the request ends."""
        offers = body.get("offers")
        if not isinstance(offers, list) or len(offers) > 4096:
            raise BadRequest("offers must be a list of at most 4096 [root, keys, first, cut(, tenant)] entries")
        checked = []
        for o in offers:
            if not isinstance(o, list) or len(o) not in (4, 5):
                raise BadRequest("each offer must be [root, keys, first, cut] or [root, keys, first, cut, tenant]")
            root, keys, first, cut, tenant = (*o, None) if len(o) == 4 else o
            if tenant is not None and (not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT):
                raise BadRequest(f"an offer's tenant must be nil or a name of 1..{MAX_TENANT} characters")
            if root is not None and (type(root) is not bytes or not 1 <= len(root) <= 64):
                raise BadRequest("an offer's root must be nil or 1..64 bytes")
            if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first < 1 << 31:
                raise BadRequest(f"an offer's first must be an int >= 0, got {first!r}")
            if not isinstance(cut, bool):
                raise BadRequest("an offer's cut must be true or false")
            checked.append((root, validate_keys(keys), first, cut, tenant))
        namespace(s)  # a BadRequest before HELLO
        answers = self.store.signals.offered(s, checked)
        return {"store": [now for now, _ in answers], "idle": [idle for _, idle in answers]}

    def touch(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """Attention mass per block for the policies."""
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
        namespace(s)  # a BadRequest before HELLO
        return {"touched": self.store.signals.touch(s, keys, scores)}

    def stats(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """The stats snapshot, or with ``samples`` the sample ring."""
        if body.get("samples"):  # the sample ring instead of the snapshot
            return self.srv.samples.snapshot() if self.srv.samples is not None else {"interval_s": 0, "samples": []}
        return self.srv.stats()

    def health(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """ok or degraded, with the reason."""
        reason = self.store.snapshots.health()
        return {"status": "degraded" if reason else "ok", "reason": reason}

    def verify(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """Decode every disk value; optionally drop the bad ones."""
        return self.store.transfers.verify(bool(body.get("drop", False)))

    def config(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """The effective settings and where each came from (the password masked)."""
        settings = self.srv.cfg.to_dict()
        if settings["remote"].get("password"):
            settings["remote"]["password"] = "***"
        return {"settings": settings, "sources": dict(self.srv.cfg.sources)}

    def tune(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """Change settings on the running daemon: all are checked first; a bad one changes nothing."""
        import copy

        settings = body.get("settings")
        if not isinstance(settings, dict) or not settings:
            raise BadRequest("settings must be a non-empty map of KEY to VALUE")
        new = copy.deepcopy(self.srv.cfg)
        try:
            for key, value in settings.items():
                tuning.check_restart_only(key)
                new.set(key, value, "tune")
            new.validate()
            self.store.tuner.apply(new, set(settings))
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        self.srv.cfg = new
        if "server.log_level" in settings:
            logging.getLogger().setLevel(new.server.log_level.upper())
        return {"applied": sorted(settings)}

    def pin(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """Keep a prefix in host memory until unpinned."""
        keys = validate_keys(body.get("keys"))
        return {"pinned": self.store.retention.pin_prefix(s, keys, body.get("priority", 80))}

    def unpin(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """Make pinned blocks evictable again."""
        return {"unpinned": self.store.retention.unpin(s, validate_keys(body.get("keys")))}

    def window(self, conn: socket.socket, s: Session, body: dict) -> dict:
        """Fit a live sequence into a host budget; the rest goes to disk."""
        budget, sinks, recent = (body.get(k) for k in ("budget", "sinks", "recent"))
        if not (isinstance(budget, int) and isinstance(sinks, int) and isinstance(recent, int)):
            raise BadRequest("budget, sinks and recent must be ints")
        return {"demoted": self.store.retention.window(s, validate_keys(body.get("keys")), budget, sinks, recent)}


def _flag(body: dict, name: str, default: bool) -> bool:
    """A boolean field of a request body (``default`` when absent); anything but a bool is a BadRequest."""
    value = body.get(name, default)
    if type(value) is not bool:
        raise BadRequest(f"{name} must be a bool, got {value!r}")
    return value

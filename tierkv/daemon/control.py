"""The operator's control API: pin, unpin, warm and delete a prefix given as token ids, and the daemon's
status, as JSON over HTTP beside ``/metrics`` (:mod:`tierkv.daemon.metrics` routes ``/v1/...`` here).

A prefix names a model (every namespace registered under that model id: each TP rank's, each
identity's unless ``identity`` narrows it), its token ids and optionally the tenant's ``cache_salt``;
its keys are the ones an engine computes for that prompt. An operation runs as a connection of its own
bound to each namespace, through the same paths an engine's requests take (retention, fetch). Every
operation that changes or deletes anything needs the bearer token read from ``server.control_token_file``
(without one configured they are refused); ``GET /v1/status`` is open.
"""

from __future__ import annotations

import hmac
import itertools
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tierkv.cache.block import MAX_TENANT, Session
from tierkv.core.errors import BadRequest, TierFull, TierKVError
from tierkv.core.keys import Namespace, chain_keys, salt_root
from tierkv.daemon.blockstore import BlockStore

__all__ = ["Control", "read_token"]

MAX_TOKENS = 1 << 20  # token ids one prompt may name
MAX_PROMPTS = 4096  # prompts one warm may name
TIERS = frozenset({"gpu", "host", "disk", "remote"})
_SESSION_IDS = itertools.count(-1, -1)  # control sessions never collide with a connection's id


def read_token(path: str) -> str:
    """The bearer token in ``path`` (surrounding whitespace stripped).

    Raises:
        ValueError: the file cannot be read or holds no token.
    """
    try:
        if Path(path).stat().st_mode & 0o077:
            raise ValueError(f"server.control_token_file: {path} is readable by others than its owner "
                             "(chmod 600 it)")
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"server.control_token_file: cannot read {path}: {exc.strerror or exc}") from None
    if len(token) < 16:
        raise ValueError(f"server.control_token_file: {path} must hold a token of at least 16 characters")
    return token


class Control:
    """The control API of one running store.

    Args:
        store: the daemon's block store.
        token: the bearer token operations that change anything need (None: they are refused).
    """

    def __init__(self, store: BlockStore, token: str | None) -> None:
        self.store, self.token = store, token
        self._ops: dict[str, Callable[[dict], dict]] = {
            "pin": self.pin, "unpin": self.unpin, "warm": self.warm, "delete": self.delete, "quotas": self.quota}

    def handle(self, method: str, path: str, auth: str | None, body: bytes) -> tuple[int, dict]:
        """(HTTP status, JSON body) of one request to ``/v1/<op>``."""
        op = path.removeprefix("/v1/")
        try:
            if op == "status" and method == "GET":
                return 200, self.status()
            if op == "tenants" and method == "GET":
                return 200, self.tenants()
            if op not in self._ops or method != "POST":
                return 404, {"error": f"no {method} {path} (GET /v1/status, /v1/tenants; POST /v1/pin, "
                                      "/v1/unpin, /v1/warm, /v1/delete, /v1/quotas)"}
            denied = self._denied(auth)
            if denied is not None:
                return denied
            try:
                req = json.loads(body or b"{}")
            except ValueError as exc:
                raise BadRequest(f"the body is not JSON: {exc}") from None
            if not isinstance(req, dict):
                raise BadRequest("the body must be a JSON object")
            return 200, self._ops[op](req)
        except TierFull as exc:
            return 409, {"error": str(exc)}
        except (BadRequest, ValueError) as exc:
            return 400, {"error": str(exc)}
        except TierKVError as exc:
            return 500, {"error": str(exc)}

    def _denied(self, auth: str | None) -> tuple[int, dict] | None:
        if self.token is None:
            return 403, {"error": "the control API changes nothing without server.control_token_file"}
        if not auth or not auth.startswith("Bearer "):
            return 401, {"error": "an Authorization: Bearer <token> header is required"}
        if not hmac.compare_digest(auth.removeprefix("Bearer ").strip().encode(), self.token.encode()):
            return 403, {"error": "the bearer token is wrong"}
        return None

    # ---- the operations ---------------------------------------------------------------------------
    def status(self) -> dict:
        """Namespaces (model, identity, layout, TP rank, blocks), pinned blocks and bytes in host memory
        and on disk, tenants with a quota, health."""
        st = self.store
        with st.ctx.lock:
            t = st.table
            namespaces = [{"fingerprint": fp.hex(), "model": ns.model, "identity": ns.identity,
                           "tp_rank": ns.tp_rank, "tp_size": ns.tp_size, "layout": ns.layout.to_dict(),
                           "blocks": t.ns_blocks.get(fp, 0)} for fp, ns in t.namespaces.items()]
            pinned = sum(1 for b in t.records() if b.pin)
            on_disk = sum(1 for b in t.records() if b.disk_pins)
            pins = {"blocks": pinned, "bytes": st.hostm.pinned_bytes, "disk_blocks": on_disk,
                    "disk_bytes": st.m.disk.pinned_bytes}
            tenants = st.m.quotas.snapshot()
        return {"health": st.snapshots.health() or "ok", "namespaces": namespaces, "pins": pins,
                "tenants": tenants}

    def tenants(self) -> dict:
        """Per tenant: bytes used and quota per tier, and the blocks fetches served it."""
        with self.store.ctx.lock:
            return {"tenants": self.store.m.quotas.snapshot()}

    def quota(self, req: dict) -> dict:
        """Set a tenant's quota per tier (``host``, ``disk``: bytes, or null for none); the tiers not named
        keep theirs. A tenant over its new quota gives up its own blocks first (the evictor runs now).
        Quotas are kept across restarts (with a disk tier)."""
        tenant = req.get("tenant")
        if not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT:
            raise BadRequest(f"tenant must be a name of 1..{MAX_TENANT} characters (the requests' cache_salt)")
        tiers = {k: v for k, v in req.items() if k != "tenant"}
        if not tiers or not set(tiers) <= {"host", "disk"}:
            raise BadRequest("name a quota for host and/or disk, in bytes (null: none)")
        for tier, limit in tiers.items():
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
                raise BadRequest(f"{tier}: a quota is bytes >= 0 or null, got {limit!r}")
        st = self.store
        with st.ctx.lock:
            st.m.set_quota(tenant, tiers)
            st.retention.keep()
            out = st.m.quotas.snapshot().get(tenant, {"used": {}, "quota": dict.fromkeys(tiers), "hits": 0})
        st.ctx.kick()
        return {"tenant": tenant, **out}

    def pin(self, req: dict) -> dict:
        """Keep the prefix in host memory (loading it from disk or the remote tier), or with ``tier``
        ``disk`` on disk, until unpinned as many times as pinned."""
        priority, tier = req.get("priority", 80), _pin_tier(req)
        if isinstance(priority, bool) or not isinstance(priority, int) or not 1 <= priority <= 100:
            raise BadRequest("priority must be an int in 1..100")
        out = {"pinned": 0, "missing": 0}
        for s, keys in self._prefixes(req):
            n = self.store.retention.pin_prefix(s, keys, priority, tier=tier)
            out["pinned"] += n
            out["missing"] += len(keys) - n
        return out

    def unpin(self, req: dict) -> dict:
        """End one pin of the prefix's blocks (in ``tier``: host, the default, or disk); a block pinned
        twice stays pinned until unpinned twice."""
        tier, n = _pin_tier(req), 0
        for s, keys in self._prefixes(req):
            n += self.store.retention.unpin(s, keys, tier)
        return {"unpinned": n}

    def warm(self, req: dict) -> dict:
        """Bring cached prefixes into host memory: ``tokens`` (one prompt) or ``prompts`` (a list of
        them); how many blocks came from each tier, were there already or not cached, the bytes brought
        in and the seconds it took."""
        t0 = time.monotonic()
        came: dict[str, int] = {}
        missing = loaded = 0
        st = self.store
        prompts = req.get("prompts")
        if prompts is not None:
            if not isinstance(prompts, list) or not prompts or len(prompts) > MAX_PROMPTS:
                raise BadRequest(f"prompts must be a list of 1..{MAX_PROMPTS} lists of token ids")
            reqs = [{**req, "tokens": p, "prompts": None} for p in prompts]
            for r in reqs:
                _tokens(r["tokens"])  # every prompt checked before any is warmed
        else:
            reqs = [req]
        for r in reqs:
            for s, keys in self._prefixes(r):
                assert s.ns is not None
                st.signals.requested(s, keys)
                lease, _offs, tiers = st.fetch_path.acquire(s, s.ns, keys)
                st.sessions.release(s, [lease])
                here = sum(1 for t in tiers if t == "host")
                for tier in tiers:
                    came[tier] = came.get(tier, 0) + 1
                loaded += (len(tiers) - here) * s.ns.layout.block_bytes
                missing += len(keys) - len(tiers)
        warmed = sum(n for tier, n in came.items() if tier != "host")
        return {"warmed": warmed, "already": came.get("host", 0), "from": came, "missing": missing,
                "prompts": len(reqs), "bytes": loaded, "seconds": round(time.monotonic() - t0, 4)}

    def delete(self, req: dict) -> dict:
        """Drop the prefix's blocks, or without ``tokens`` every block of the model's namespaces, or with
        ``tenant`` every block that tenant stored (in the model's namespaces when ``model`` is given,
        else in all), from ``tiers`` (default every tier: the local ones and the remote copies this
        daemon knows of); pinned ones only with ``force``; blocks in use by an engine stay."""
        force, tiers = req.get("force", False), req.get("tiers", sorted(TIERS))
        if not isinstance(force, bool):
            raise BadRequest("force must be true or false")
        if not isinstance(tiers, list) or not tiers or not set(tiers) <= TIERS:
            raise BadRequest(f"tiers must be a list of {', '.join(sorted(TIERS))}")
        n, tenant = 0, req.get("tenant")
        if tenant is not None:
            if not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT:
                raise BadRequest(f"tenant must be a name of 1..{MAX_TENANT} characters (the requests' cache_salt)")
            if req.get("tokens") is not None:
                raise BadRequest("delete a prefix (tokens, salt) or a tenant's blocks (tenant), not both")
            fps = None if req.get("model") is None else {ns.fingerprint for ns in self._namespaces(req)}
            n = self.store.retention.drop_tenant(tenant, fps, frozenset(tiers), force)
        elif req.get("tokens") is None:
            for ns in self._namespaces(req):
                with self._session(ns) as s:
                    n += self.store.retention.drop(s, None, frozenset(tiers), force)
        else:
            for s, keys in self._prefixes(req):
                n += self.store.retention.drop(s, keys, frozenset(tiers), force)
        return {"deleted": n}

    # ---- what a request names ---------------------------------------------------------------------
    def _prefixes(self, req: dict) -> Iterator[tuple[Session, list[bytes]]]:
        """Per namespace the request names, a control session bound to it and the prefix's keys."""
        tokens, salt = _tokens(req.get("tokens")), req.get("salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise BadRequest("salt must be a non-empty string (a request's cache_salt) or absent")
        for ns in self._namespaces(req):
            fp, bt = ns.fingerprint, ns.layout.block_tokens
            keys = chain_keys(fp, tokens, bt, salt_root(fp, salt))
            if not keys:
                raise BadRequest(f"the prefix has {len(tokens)} tokens: less than one block of {bt}")
            with self._session(ns) as s:
                yield s, keys

    def _namespaces(self, req: dict) -> list[Namespace]:
        model, identity = req.get("model"), req.get("identity")
        if not isinstance(model, str) or not model:
            raise BadRequest("model is required: the model id the engines registered")
        if identity is not None and not isinstance(identity, str):
            raise BadRequest("identity must be a string (a prefix of the identity digest)")
        with self.store.ctx.lock:
            found = [ns for ns in self.store.table.namespaces.values()
                     if ns.model == model and (not identity or ns.identity.startswith(identity))]
        if not found:
            raise BadRequest(f"no engine has registered model {model!r}"
                             + (f" with identity {identity}" if identity else "") + " with this daemon")
        return found

    @contextmanager
    def _session(self, ns: Namespace) -> Iterator[Session]:
        s = Session(next(_SESSION_IDS))
        self.store.sessions.register(s, ns)
        try:
            yield s
        finally:
            self.store.sessions.close(s)


def _pin_tier(req: dict) -> str:
    tier = req.get("tier", "host")
    if tier not in ("host", "disk"):
        raise BadRequest(f"tier must be host or disk (where the pin keeps the blocks), got {tier!r}")
    return str(tier)


def _tokens(value: object) -> list[int]:
    if not isinstance(value, list) or not value or len(value) > MAX_TOKENS:
        raise BadRequest(f"tokens must be a list of 1..{MAX_TOKENS} token ids")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 1 << 31:
            raise BadRequest(f"tokens must be token ids (ints in 0..2^31), got {t!r}")
    return value

"""The operator's side of the daemon's control API (:mod:`tierkv.daemon.control`): pin, unpin, warm and
delete a prompt's prefix, and read the daemon's status, over HTTP on the daemon's metrics address.

    from tierkv.client.control_api import ControlClient
    ctl = ControlClient("127.0.0.1:9464", token_file="/etc/tierkv/token")
    ctl.pin("my-model", system_prompt_ids)
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tierkv.core.errors import BadRequest, ConnectionFailed, PermissionDenied, TierFull, TierKVError

__all__ = ["ControlClient"]


class ControlClient:
    """Calls to one daemon's control API.

    Args:
        addr: the daemon's ``server.metrics_addr`` (``HOST:PORT`` or ``PORT`` on loopback).
        token: the bearer token (``server.control_token_file``'s content); or
        token_file: a file holding it. Without either only :meth:`status` works.
        timeout: seconds one call may take (a warm of a long prefix reads it from disk first).
    """

    def __init__(self, addr: str, token: str | None = None, token_file: str | None = None,
                 timeout: float = 120.0) -> None:
        host, _, port = addr.rpartition(":")
        self.url = f"http://{host or '127.0.0.1'}:{port}/v1/"
        self.token = token if token is not None else (Path(token_file).read_text().strip() if token_file else None)
        self.timeout = timeout

    def status(self) -> dict[str, Any]:
        """Health, the namespaces engines registered (model, identity, layout, TP rank, blocks), pins (in
        host memory and on disk) and the tenants with a quota."""
        return self._call("GET", "status", None)

    def tenants(self) -> dict[str, Any]:
        """Per tenant: bytes used and quota per tier (``host``, ``disk``), and the blocks fetches served it."""
        return self._call("GET", "tenants", None)

    def set_quota(self, tenant: str, **tiers: int | None) -> dict[str, Any]:
        """Set ``tenant``'s quota in bytes per tier (``host=``, ``disk=``; None: no quota there); returns
        its use and quotas."""
        return self._call("POST", "quotas", {"tenant": tenant, **tiers})

    def pin(self, model: str, tokens: Sequence[int], salt: str | None = None, identity: str | None = None,
            priority: int = 80, tier: str = "host") -> dict[str, Any]:
        """Keep the cached prefix of ``tokens`` in host memory (``tier="disk"``: on disk) until unpinned as
        many times as pinned: ``pinned`` blocks (of every namespace of ``model``), ``missing`` ones that
        were not cached.

        Raises:
            TierFull: it would exceed the tier's ``max_pinned_fraction`` (the message says by how many bytes).
        """
        return self._call("POST", "pin", _prefix(model, tokens, salt, identity) | {"priority": priority, "tier": tier})

    def unpin(self, model: str, tokens: Sequence[int], salt: str | None = None,
              identity: str | None = None, tier: str = "host") -> dict[str, Any]:
        """End one pin of the prefix's blocks in ``tier``: ``unpinned`` blocks."""
        return self._call("POST", "unpin", _prefix(model, tokens, salt, identity) | {"tier": tier})

    def warm(self, model: str, tokens: Sequence[int] | None = None, salt: str | None = None,
             identity: str | None = None, prompts: Sequence[Sequence[int]] | None = None) -> dict[str, Any]:
        """Bring the cached prefix of ``tokens`` (or of each of ``prompts``) into host memory: ``warmed``
        blocks, ``from`` (per tier), ``already`` in host memory, ``missing`` (not cached), ``bytes`` and
        ``seconds``."""
        body = _prefix(model, tokens, salt, identity)
        if prompts is not None:
            body["prompts"] = [[int(t) for t in p] for p in prompts]
        return self._call("POST", "warm", body)

    def delete(self, model: str | None, tokens: Sequence[int] | None, salt: str | None = None,
               identity: str | None = None, force: bool = False, tiers: Sequence[str] | None = None,
               tenant: str | None = None) -> dict[str, Any]:
        """Drop the prefix's blocks, or with ``tokens`` None every block of the model's namespaces, or
        with ``tenant`` every block that tenant stored (of ``model``, or with it None of every model), from
        ``tiers`` (``gpu``, ``host``, ``disk``, ``remote``: the remote copies this daemon knows of; default
        all), pinned ones only with ``force``: ``deleted`` blocks."""
        body = ({} if model is None else _prefix(model, tokens, salt, identity)) | {"force": force}
        if tenant is not None:
            body["tenant"] = tenant
        if tiers is not None:
            body["tiers"] = list(tiers)
        return self._call("POST", "delete", body)

    def _call(self, method: str, op: str, body: dict | None) -> dict[str, Any]:
        req = urllib.request.Request(self.url + op, method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return dict(json.loads(r.read()))
        except urllib.error.HTTPError as exc:
            try:
                why = json.loads(exc.read()).get("error", exc.reason)
            except ValueError:
                why = exc.reason
            raise _ERRORS.get(exc.code, TierKVError)(str(why)) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ConnectionFailed(f"cannot reach the control API at {self.url}: {exc}") from None


_ERRORS: dict[int, type[TierKVError]] = {400: BadRequest, 401: PermissionDenied, 403: PermissionDenied,
                                         404: BadRequest, 409: TierFull}


def _prefix(model: str, tokens: Sequence[int] | None, salt: str | None, identity: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model}
    if tokens is not None:
        body["tokens"] = [int(t) for t in tokens]
    if salt is not None:
        body["salt"] = salt
    if identity is not None:
        body["identity"] = identity
    return body

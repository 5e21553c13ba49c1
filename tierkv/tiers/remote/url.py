"""Remote URLs and keys: where a remote tier connects, how a URL is shown in logs, how a block is named.

``redis://[user:pass@]host:port/db``, ``rediss://...`` (TLS), ``unix:///path.sock?db=N``, and cluster
seed lists ``redis+cluster://[user:pass@]h1:p1,h2:p2`` (``rediss+cluster://`` for TLS). Query options
are redis-py's (``ssl_ca_certs=...``, ``ssl_cert_reqs=required``, ...); redis-py parses them, imported
only when a URL is parsed so that reading a config does not load it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from tierkv.core.errors import BadRequest
from tierkv.core.keys import FINGERPRINT_BYTES, MAX_KEY_BYTES

__all__ = ["KEY_PREFIX", "SCHEMES", "Target", "parse_remote_url", "redact_url", "remote_key"]

KEY_PREFIX = b"tierkv:"
SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


@dataclass(frozen=True)
class Target:
    """Where a remote tier connects.

    Attributes:
        cluster: the URL names a cluster.
        options: redis-py's connection settings from the URL (host, port, db, path, username, password,
            ssl_*, connection_class); a cluster's carry no host, port or db.
        seeds: (host, port) pairs of a cluster's seed nodes.
    """

    cluster: bool
    options: dict[str, Any]
    seeds: tuple[tuple[str, int], ...] = ()


def parse_remote_url(url: str, *, cluster: bool = False) -> Target:
    """Parse a remote URL.

    Args:
        url: a URL of one of :data:`SCHEMES`.
        cluster: treat a ``redis://`` / ``rediss://`` URL as a cluster seed.

    Raises:
        ValueError: the URL is unusable (the message says why).
    """
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"remote URL must look like redis://host:port, got {url!r}")
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"unknown remote URL scheme {scheme!r} ({', '.join(SCHEMES)})")
    url = f"{scheme}://{rest}"  # schemes are case-insensitive (RFC 3986); redis-py takes lower case only
    if scheme.endswith("+cluster"):
        return _cluster_url(url, scheme)
    opts = _redis_parse(url)
    _check_place(url, scheme, opts)
    if not cluster:
        return Target(False, opts)
    if scheme == "unix":
        raise ValueError("a cluster cannot be reached over a Unix socket")
    if opts.get("db", 0):
        raise ValueError("a cluster has only database 0")
    seed = (opts.pop("host", "localhost"), int(opts.pop("port", 6379)))
    opts.pop("db", None)
    return Target(True, opts, (seed,))


def _cluster_url(url: str, scheme: str) -> Target:
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ValueError(f"remote URL {redact_url(url)!r} is malformed: {exc}") from None
    creds, _, hosts = parts.netloc.rpartition("@")
    seeds = []
    for hp in filter(None, hosts.split(",")):
        host, _, port = hp.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"cluster seed {hp!r} must be host:port (port 1..65535)")
        seeds.append((host.strip("[]"), int(port)))
    if not seeds:
        raise ValueError("a cluster URL needs at least one host:port seed")
    if parts.path not in ("", "/", "/0"):
        raise ValueError("a cluster has only database 0")
    base = urlunsplit((scheme.split("+")[0], (creds + "@" if creds else "") + "%s:%d" % seeds[0], "",
                       parts.query, ""))
    opts = _redis_parse(base)
    for k in ("host", "port", "db"):
        opts.pop(k, None)
    return Target(True, opts, tuple(seeds))


def _check_place(url: str, scheme: str, opts: dict[str, Any]) -> None:
    """Reject what redis-py lets pass silently: no socket path, no host, a database that is no number."""
    if scheme == "unix":
        if not opts.get("path"):
            raise ValueError("a unix:// URL needs a socket path: unix:///path/to/redis.sock")
        return
    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError(f"remote URL {redact_url(url)!r} has no host")
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        raise ValueError(f"remote URL {redact_url(url)!r}: the database must be a number, got {db!r}")


def _redis_parse(url: str) -> dict[str, Any]:
    from redis.connection import parse_url

    try:
        return parse_url(url)
    except ValueError as exc:  # redis-py's messages name the bad part; keep the password out of them
        raise ValueError(f"remote URL {redact_url(url)!r}: {exc}") from None


def redact_url(url: str) -> str:
    """The URL without its password (for logs and stats)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if "@" not in parts.netloc:
        return url
    creds, _, hosts = parts.netloc.rpartition("@")
    user = creds.split(":", 1)[0]
    netloc = (quote(unquote(user)) + ":***@" if user else "***@") + hosts
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


def remote_key(fingerprint: bytes, key: bytes, prefix: bytes = KEY_PREFIX) -> bytes:
    """The Redis key of a block: ``prefix + fingerprint hex + ":" + key hex``.

    Hex keeps keys printable in ``redis-cli`` and ACL patterns simple (``~tierkv:*``); a key costs about 100
    bytes against the 2 MiB value it names.

    Raises:
        BadRequest: the fingerprint is not 16 bytes or the key not 1..MAX_KEY_BYTES bytes.
    """
    if type(fingerprint) is not bytes or len(fingerprint) != FINGERPRINT_BYTES:
        raise BadRequest(f"fingerprint must be {FINGERPRINT_BYTES} bytes")
    if type(key) is not bytes or not 0 < len(key) <= MAX_KEY_BYTES:
        raise BadRequest(f"block key must be 1..{MAX_KEY_BYTES} bytes")
    return b"%s%s:%s" % (prefix, fingerprint.hex().encode(), key.hex().encode())

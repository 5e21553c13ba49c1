"""Remote tier: encoded blocks in Redis or Valkey (standalone or cluster), shared by every node of a fleet.

A prefix computed on node A is a hit on node B: both sidecars read and write the same keys,
``tierkv:<namespace fingerprint hex>:<block key hex>``, whose values are block containers
(``tierkv.codecs``). Every value read is untrusted: :meth:`RemoteTier.fetch_verified` decodes it into the
caller's buffer and a value that fails (wrong checksum, namespace, layout, key, truncated, garbage) is a
miss, counted and deleted.

Wire path. Commands are pipelined in batches (``max_batch`` keys or ``batch_bytes``, whichever comes
first); in a cluster the keys of a batch are grouped by the node that owns their slot, every node gets
its part before any reply is read, so the nodes work in parallel. Keys carry no hash tag: a tag per
namespace would put a whole model on one slot, so one node would hold it and serve every read of it.
Values go out through redis-py's pure-Python packer, which passes memoryviews and large bytes to
``sendall`` as they are (the default hiredis packer copies each value twice). Replies are read straight
from the connection's socket with ``recv_into`` into the destination buffer (one copy, from the kernel);
redis-py's pure-Python parser copies a 2 MiB value several times, hiredis twice. Connections are still
redis-py's (connect, AUTH, TLS, SELECT, timeouts); only the replies of our own pipelines are read from its
private ``_sock``, with RESP2 so that the server never sends anything unasked. Where that attribute is
missing, or with ``fast_reads=False``, redis-py's parser reads the replies.

Failures. Connection errors, timeouts and server errors that are not about one key (LOADING, CLUSTERDOWN,
NOAUTH, NOPERM on a read, ...) open a circuit breaker: while it is open, reads are misses, writes are
dropped and nothing touches the network; after a backoff (``backoff_s`` doubling up to ``max_backoff_s``,
with jitter) one call is let through as a probe, and its success closes the breaker. A full server
(``OOM`` under ``noeviction``), a write the ACL denies (``NOPERM``), a read-only replica or a failing
``bgsave`` (``MISCONF``) open only the write breaker: reads keep being served ("read-only" state).
Nothing here raises to the caller for a remote failure; only caller misuse raises (``BadRequest``).

Threads. The class is thread-safe and every public method is blocking network I/O bounded by the socket
timeouts (each send and receive waits at most ``socket_timeout``; a failure ends the call at once).
Call it from transfer-engine worker threads, never while holding the block table's lock. Calls from
different threads use different pooled connections and run in parallel.
"""

from __future__ import annotations

import inspect
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.connection import (
    AbstractConnection,
    Connection,
    ConnectionPool,
    Encoder,
    PythonRespSerializer,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)
from redis.exceptions import RedisClusterException, RedisError, ResponseError
from redis.retry import Retry

from tierkv.core.errors import BadRequest
from tierkv.core.keys import FINGERPRINT_BYTES, MAX_KEY_BYTES

if TYPE_CHECKING:
    from tierkv.cache.policy.admission import Admission
    from tierkv.cache.policy.history import History

log = logging.getLogger("tierkv.remote")

__all__ = ["ADMISSION_MODES", "RemoteConfig", "RemoteTier", "make_admission", "parse_remote_url",
           "redact_url", "remote_key"]

ADMISSION_MODES = ("all", "reused", "pinned")
KEY_PREFIX = b"tierkv:"
_MAX_LINE = 64 << 10  # a reply line (type + length or error text) longer than this is a broken stream
_READ_CHUNK = 64 << 10
_EMA_ALPHA = 0.2
_BIG = 1 << 62

# One packer for every connection: it only holds settings. Large values and memoryviews are passed to
# sendall untouched; small arguments are joined into one buffer.
_PACKER = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
# No CLIENT SETINFO on connect: two round trips less per connection, and no ACL rule needed for it.
_NO_DRIVER_INFO = ({"driver_info": None} if "driver_info" in inspect.signature(AbstractConnection.__init__).parameters
                   else {"lib_name": None, "lib_version": None})


class _ZeroCopy:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["command_packer"] = _PACKER
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]


class TcpConnection(_ZeroCopy, Connection):
    """redis-py TCP connection with the zero-copy packer."""


class TlsConnection(_ZeroCopy, SSLConnection):
    """redis-py TLS connection with the zero-copy packer."""


class UnixConnection(_ZeroCopy, UnixDomainSocketConnection):
    """redis-py Unix-socket connection with the zero-copy packer."""


_OURS = {Connection: TcpConnection, SSLConnection: TlsConnection, UnixDomainSocketConnection: UnixConnection}


# ---- configuration and URLs -------------------------------------------------------------------------


@dataclass
class RemoteConfig:
    """The remote tier (Redis or Valkey shared by the nodes of a fleet)."""

    url: str = ""
    """``redis://[user:pass@]host:port/db``, ``rediss://...`` (TLS), ``unix:///path.sock?db=N``, or a cluster
    seed list ``redis+cluster://[user:pass@]h1:p1,h2:p2`` (``rediss+cluster://`` for TLS). Empty: no remote
    tier. Query options are redis-py's (``ssl_ca_certs=...``, ``ssl_cert_reqs=required``, ...)."""
    username: str = ""
    """ACL user (overrides the URL's)."""
    password: str = ""
    """Password (overrides the URL's); prefer ``TIERKV_REMOTE_PASSWORD`` to a file or flag."""
    cluster: bool = False
    """Treat a plain ``redis://``/``rediss://`` URL as a cluster seed."""
    admission: Literal["all", "reused", "pinned"] = "reused"
    """Which blocks are written through: every one, those used twice / shared / pinned, or pinned only."""
    codec: str = "lossless"
    """Codec of blocks encoded for the remote tier (blocks already encoded for disk are sent as they are)."""
    ttl_s: float = 0.0
    """Expire values this long after their last write (0: never; eviction is then Redis's own)."""
    socket_timeout_s: float = 2.0
    """Longest wait for one send or receive."""
    connect_timeout_s: float = 1.0
    """Longest wait to connect."""
    max_batch: int = 16
    """Most keys in one pipelined round trip."""
    batch_bytes: int = 32 << 20
    """Most value bytes sent in one pipelined round trip."""
    backoff_s: float = 0.5
    """First wait before retrying a failed remote; doubles on each failure."""
    max_backoff_s: float = 30.0
    """Longest wait between retries."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting."""
        if self.url:
            parse_remote_url(self.url, cluster=self.cluster)
        if self.admission not in ADMISSION_MODES:
            raise ValueError(f"remote.admission must be one of {', '.join(ADMISSION_MODES)}")
        from tierkv.codecs import available_codecs

        if self.codec not in available_codecs():
            raise ValueError(f"remote.codec: unknown codec {self.codec!r} (known: {', '.join(available_codecs())})")
        for name in ("socket_timeout_s", "connect_timeout_s", "backoff_s", "max_backoff_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"remote.{name} must be > 0")
        if self.ttl_s < 0:
            raise ValueError("remote.ttl_s must be >= 0")
        if self.max_batch < 1 or self.batch_bytes < 1:
            raise ValueError("remote.max_batch and remote.batch_bytes must be >= 1")


@dataclass(frozen=True)
class Target:
    """Where a remote tier connects: ``seeds`` are (host, port) pairs of a cluster, ``options`` redis-py's
    connection settings from the URL (host, port, db, path, username, password, ssl_*, connection_class)."""

    cluster: bool
    options: dict[str, Any]
    seeds: tuple[tuple[str, int], ...] = ()


def parse_remote_url(url: str, *, cluster: bool = False) -> Target:
    """Parse a remote URL (see :class:`RemoteConfig`); raise ``ValueError`` if it is unusable."""
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"remote URL must look like redis://host:port, got {url!r}")
    scheme = url.split("://", 1)[0].lower()
    if scheme in ("redis+cluster", "rediss+cluster"):
        parts = urlsplit(url)
        creds, _, hosts = parts.netloc.rpartition("@")
        seeds = []
        for hp in filter(None, hosts.split(",")):
            host, _, port = hp.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"cluster seed {hp!r} must be host:port")
            seeds.append((host.strip("[]"), int(port)))
        if not seeds:
            raise ValueError("a cluster URL needs at least one host:port seed")
        if parts.path not in ("", "/", "/0"):
            raise ValueError("a cluster has only database 0")
        base = urlunsplit((scheme.split("+")[0], (creds + "@" if creds else "") + "%s:%d" % seeds[0], "",
                           parts.query, ""))
        opts = parse_url(base)
        for k in ("host", "port", "db"):
            opts.pop(k, None)
        return Target(True, opts, tuple(seeds))
    if scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"unknown remote URL scheme {scheme!r} (redis, rediss, unix, redis+cluster, "
                         f"rediss+cluster)")
    opts = parse_url(url)
    if cluster:
        if scheme == "unix":
            raise ValueError("a cluster cannot be reached over a Unix socket")
        if opts.get("db", 0):
            raise ValueError("a cluster has only database 0")
        seed = (opts.pop("host", "localhost"), int(opts.pop("port", 6379)))
        opts.pop("db", None)
        return Target(True, opts, (seed,))
    return Target(False, opts)


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


def make_admission(mode: str = "reused", history: History | None = None) -> Admission:
    """An :class:`~tierkv.cache.policy.admission.Admission` for a write-through mode (for the simulator and for
    callers that keep use counts in a History).

    ``all``: every block; ``reused``: blocks used at least twice, shared by two holders, or pinned;
    ``pinned``: pinned blocks only.
    """
    from tierkv.cache.policy.admission import Admission  # tiers stay importable without the policies

    if mode == "all":
        return Admission(history, enabled=False)
    if mode == "reused":
        return Admission(history)
    if mode == "pinned":
        return Admission(history, min_seen=_BIG, min_sharers=_BIG)
    raise ValueError(f"admission mode must be one of {', '.join(ADMISSION_MODES)}, got {mode!r}")


# ---- circuit breaker ----------------------------------------------------------------------------------


class _Breaker:
    """Closed (up) until a failure; then open for a backoff, after which one caller probes."""

    def __init__(self, base: float, cap: float) -> None:
        self.base, self.cap = base, cap
        self.up = True
        self.failures = 0
        self.until = 0.0
        self.probing = False
        self.reason = ""

    def allow(self, now: float) -> bool:
        """Whether a call may go out now (True for at most one probe while open). Caller holds the lock."""
        if self.up:
            return True
        if self.probing or now < self.until:
            return False
        self.probing = True
        return True

    def success(self) -> bool:
        """Close; returns True if it was open."""
        was_down = not self.up
        self.up, self.failures, self.probing, self.reason = True, 0, False, ""
        return was_down

    def failure(self, now: float, reason: str) -> None:
        self.failures += 1
        wait = min(self.cap, self.base * 2 ** min(self.failures - 1, 30))
        self.until = now + wait * random.uniform(0.8, 1.2)  # jitter: N sidecars do not retry in step
        self.up, self.probing, self.reason = False, False, reason

    def release(self) -> None:
        """A probe ended without a verdict (nothing was sent)."""
        self.probing = False


# ---- replies ------------------------------------------------------------------------------------------


class ReplyError(str):
    """An error reply of one command (``"OOM command not allowed ..."``); the stream is still in sync."""

    @property
    def code(self) -> str:
        return self.split(" ", 1)[0]


class _Desync(RedisError):
    """The reply stream broke the protocol: the connection cannot be reused."""


_SKIPPED = object()  # a bulk value that was read and thrown away (over the size limit)
Into = Callable[[int], "memoryview | None"]


class _SocketReader:
    """RESP2 replies read from a connected redis-py connection's socket; bulk values land in the buffer
    ``into(n)`` returns with one copy from the kernel."""

    __slots__ = ("sock", "buf", "pos", "end")

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.buf = bytearray(_READ_CHUNK)
        self.pos = self.end = 0

    def _fill(self) -> None:
        if self.pos == self.end:
            self.pos = self.end = 0
        elif self.end == len(self.buf):
            rest = self.end - self.pos
            self.buf[:rest] = self.buf[self.pos:self.end]
            self.pos, self.end = 0, rest
        n = self.sock.recv_into(memoryview(self.buf)[self.end:])
        if not n:
            raise redis.ConnectionError("the server closed the connection")
        self.end += n

    def _line(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n", self.pos, self.end)
            if i >= 0:
                line = bytes(self.buf[self.pos:i])
                self.pos = i + 2
                return line
            if self.end - self.pos >= _MAX_LINE:
                raise _Desync("reply line too long")
            self._fill()

    def reply(self, into: Into | None = None) -> Any:
        """One reply: bytes (bulk or status), int, None (nil), ReplyError, or _SKIPPED."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        try:
            if kind == b"$":
                n = int(rest)
                return None if n < 0 else self._bulk(n, into)
            if kind == b"+":
                return rest
            if kind == b":":
                return int(rest)
        except ValueError:
            raise _Desync(f"bad reply {line[:40]!r}") from None
        if kind == b"-":
            return ReplyError(rest.decode("utf-8", "replace"))
        if kind == b"_":
            return None
        raise _Desync(f"unexpected reply {line[:40]!r}")

    def _bulk(self, n: int, into: Into | None) -> Any:
        dst = into(n) if into is not None else memoryview(bytearray(n))
        have = min(self.end - self.pos, n)
        if dst is not None:
            dst[:have] = memoryview(self.buf)[self.pos:self.pos + have]
        self.pos += have
        got = have
        while got < n:
            if dst is not None:
                k = self.sock.recv_into(dst[got:n])
                if not k:
                    raise redis.ConnectionError("the server closed the connection")
                got += k
            else:  # over the limit: drain it through the line buffer without keeping it
                self.pos = self.end = 0
                k = self.sock.recv_into(memoryview(self.buf)[:min(len(self.buf), n - got)])
                if not k:
                    raise redis.ConnectionError("the server closed the connection")
                got += k
        while self.end - self.pos < 2:
            self._fill()
        if self.buf[self.pos:self.pos + 2] != b"\r\n":
            raise _Desync("bulk value not followed by CRLF")
        self.pos += 2
        return dst[:n] if dst is not None else _SKIPPED

    def finish(self) -> None:
        if self.pos != self.end:
            raise _Desync(f"{self.end - self.pos} unexpected bytes after the replies")


class _ParserReader:
    """The same interface over redis-py's own parser (``fast_reads=False``, or no raw socket)."""

    __slots__ = ("conn",)

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def reply(self, into: Into | None = None) -> Any:
        try:
            value = self.conn.read_response(disable_decoding=True)
        except ResponseError as exc:
            return ReplyError(str(exc))
        if isinstance(value, (bytes, bytearray)) and into is not None:
            dst = into(len(value))
            if dst is None:
                return _SKIPPED
            dst[:len(value)] = value
            return dst[:len(value)]
        return value

    def finish(self) -> None:
        pass


# ---- the tier -----------------------------------------------------------------------------------------


@dataclass
class _Counters:
    gets: int = 0            # keys asked for
    hits: int = 0
    misses: int = 0          # absent, skipped while down, or failed
    corrupt: int = 0         # values that failed verification (or were not strings)
    puts: int = 0            # values stored
    put_dropped: int = 0     # values not stored (down, full, denied, error)
    exists: int = 0          # keys probed with EXISTS
    deletes: int = 0         # keys deleted
    bytes_in: int = 0        # value bytes written to the remote
    bytes_out: int = 0       # value bytes read from the remote
    errors: int = 0          # failed round trips and error replies
    trips: int = 0           # times a breaker opened
    recoveries: int = 0      # times a breaker closed again
    round_trips: int = 0
    admitted: int = 0
    rejected: int = 0


class RemoteTier:
    """Blocks in a shared Redis/Valkey, standalone or cluster.

    Args:
        url: see :class:`RemoteConfig`.
        username: ACL user; overrides the URL's.
        password: overrides the URL's.
        cluster: treat a ``redis://`` / ``rediss://`` URL as a cluster seed.
        admission: ``all``, ``reused`` or ``pinned`` (see :meth:`admit`).
        ttl_s: expire values this long after their last write (None or 0: never).
        socket_timeout_s: longest wait for one send or receive.
        connect_timeout_s: longest wait to connect.
        max_batch: most keys in one pipelined round trip.
        batch_bytes: most value bytes sent in one round trip.
        backoff_s: first retry delay after a failure (doubles up to ``max_backoff_s``).
        max_backoff_s: longest retry delay.
        fast_reads: read replies with ``recv_into`` into the destination (False: redis-py's parser).
        max_value_bytes: values longer than this are drained and treated as misses (get_many).
        key_prefix: prefix of every key (default ``tierkv:``); must match the ACL key pattern.
        codec: name of the codec the remote mover encodes this tier's blocks with (the tier stores bytes).
        **redis_kwargs: extra redis-py connection settings (``ssl_ca_certs``, ``socket_keepalive``, ...).

    Nothing connects in the constructor: the first call does, so a daemon starts while its remote is down.

    Raises:
        ValueError: the URL or a setting is unusable.
    """

    def __init__(self, url: str, *, username: str | None = None, password: str | None = None, cluster: bool = False,
                 admission: str = "reused", ttl_s: float | None = None, socket_timeout_s: float = 2.0,
                 connect_timeout_s: float = 1.0, max_batch: int = 16, batch_bytes: int = 32 << 20,
                 backoff_s: float = 0.5, max_backoff_s: float = 30.0, fast_reads: bool = True,
                 max_value_bytes: int = 256 << 20, key_prefix: bytes = KEY_PREFIX, codec: str = "lossless",
                 **redis_kwargs: Any) -> None:
        self.target = parse_remote_url(url, cluster=cluster)
        if admission not in ADMISSION_MODES:
            raise ValueError(f"admission must be one of {', '.join(ADMISSION_MODES)}, got {admission!r}")
        if max_batch < 1 or batch_bytes < 1 or max_value_bytes < 1:
            raise ValueError("max_batch, batch_bytes and max_value_bytes must be >= 1")
        if not (socket_timeout_s > 0 and connect_timeout_s > 0 and backoff_s > 0 and max_backoff_s > 0):
            raise ValueError("timeouts and backoffs must be > 0")
        if ttl_s is not None and ttl_s < 0:
            raise ValueError("ttl_s must be >= 0")
        if not isinstance(key_prefix, bytes) or not key_prefix or b"{" in key_prefix:
            raise ValueError("key_prefix must be non-empty bytes without '{' (no hash tags)")
        self.url = redact_url(url)
        self.cluster = self.target.cluster
        self.admission = admission
        self.ttl_ms = int(ttl_s * 1000) if ttl_s else 0
        self.max_batch = max_batch
        self.batch_bytes = batch_bytes
        self.fast_reads = fast_reads
        self.max_value_bytes = max_value_bytes
        self.key_prefix = key_prefix
        self.codec = codec
        self.socket_timeout_s = socket_timeout_s
        opts = dict(self.target.options)
        cls = _OURS.get(opts.pop("connection_class", Connection), TcpConnection)
        if username:
            opts["username"] = username
        if password:
            opts["password"] = password
        opts.update(socket_timeout=socket_timeout_s, socket_connect_timeout=connect_timeout_s, protocol=2,
                    health_check_interval=0, **_NO_DRIVER_INFO)
        if cls is not UnixConnection:
            opts["socket_keepalive"] = True  # a dead peer is noticed on idle pooled connections
        opts.update(redis_kwargs)
        self._lock = threading.Lock()
        self._link = _Breaker(backoff_s, max_backoff_s)
        self._writes = _Breaker(backoff_s, max_backoff_s)
        self._c = _Counters()
        self._last_error = ""
        self._last_error_at = 0.0
        self._latency_ema = 0.0
        self._scratch = threading.local()
        self._pool: ConnectionPool | None = None
        self._rc: redis.RedisCluster | None = None
        self._refresh = False
        self._topology_lock = threading.Lock()
        if self.cluster:
            if cls is TlsConnection:
                ssl_opts = {k: opts.pop(k) for k in list(opts) if k.startswith("ssl_")}
                opts.pop("ssl", None)
                # RedisCluster drops ssl_* kwargs unless ssl=True, and ssl=True replaces the connection class.
                cls = type("ClusterTlsConnection", (TlsConnection,),
                           {"__init__": lambda s, **kw: TlsConnection.__init__(s, **{**ssl_opts, **kw})})
            self._cluster_opts = {**opts, "connection_class": cls}
        else:
            self._pool = ConnectionPool(connection_class=cls, **opts)

    @classmethod
    def from_config(cls, cfg: RemoteConfig, **kwargs: Any) -> RemoteTier:
        """Build from a :class:`RemoteConfig` (``cfg.url`` must be set)."""
        cfg.validate()
        if not cfg.url:
            raise ValueError("remote.url is empty: no remote tier configured")
        return cls(cfg.url, username=cfg.username or None, password=cfg.password or None, cluster=cfg.cluster,
                   admission=cfg.admission, ttl_s=cfg.ttl_s or None, socket_timeout_s=cfg.socket_timeout_s,
                   connect_timeout_s=cfg.connect_timeout_s, max_batch=cfg.max_batch, batch_bytes=cfg.batch_bytes,
                   backoff_s=cfg.backoff_s, max_backoff_s=cfg.max_backoff_s, codec=cfg.codec, **kwargs)

    # ---- public API -----------------------------------------------------------------------------------
    def key(self, fingerprint: bytes, key: bytes) -> bytes:
        """The Redis key of a block (see :func:`remote_key`)."""
        return remote_key(fingerprint, key, self.key_prefix)

    def put_many(self, items: Sequence[tuple[bytes, bytes, Any]]) -> list[bool]:
        """Store encoded blocks (write-through); ``True`` where the value was stored.

        Args:
            items: ``(fingerprint, key, blob)``; ``blob`` is an encoded block (bytes, memoryview, numpy
                array); it is sent without a copy and must stay unchanged until the call returns.

        Returns:
            One flag per item; False where the value was dropped (tier down or read-only, server full,
            ACL denial, error). Never raises for a remote failure.
        """
        keys = [self.key(fp, k) for fp, k, _ in items]
        blobs = [_flat(b) for _, _, b in items]
        ttl = (b"PX", b"%d" % self.ttl_ms) if self.ttl_ms else ()
        out = [False] * len(items)

        def build(i: int) -> tuple:
            return (b"SET", keys[i], blobs[i], *ttl)

        def read(rd: Any, i: int) -> Any:
            r = rd.reply()
            if r == b"OK":
                out[i] = True
                with self._lock:
                    self._c.puts += 1
                    self._c.bytes_in += blobs[i].nbytes
            return r

        self._run(keys, build, read, write=True, sizes=[b.nbytes for b in blobs])
        with self._lock:
            self._c.put_dropped += out.count(False)
        return out

    def count_dropped(self, n: int) -> None:
        """Count ``n`` values a caller did not send (the tier went down or read-only mid-write)."""
        with self._lock:
            self._c.put_dropped += n

    def get_many(self, items: Sequence[tuple[bytes, bytes]]) -> list[memoryview | None]:
        """Raw (unverified) values; None where absent, over ``max_value_bytes``, or the tier is down.

        The values are untrusted: decode them with ``decode_block`` (a ``CodecError`` is a miss), or use
        :meth:`fetch_verified`. Each value is its own writable buffer (a memoryview of a uint8 array).
        """
        keys = [self.key(fp, k) for fp, k in items]
        out: list[memoryview | None] = [None] * len(items)
        limit = self.max_value_bytes

        def into(n: int) -> memoryview | None:
            # np.empty: no zero-fill pass over a buffer the value overwrites anyway (bytearray(n) has one)
            return memoryview(np.empty(n, np.uint8)) if n <= limit else None

        def read(rd: Any, i: int) -> Any:
            r = rd.reply(into)
            if isinstance(r, memoryview):
                out[i] = r
                with self._lock:
                    self._c.bytes_out += r.nbytes
            elif r is _SKIPPED or isinstance(r, bytes):  # too big, or a status reply where a value belongs
                with self._lock:
                    self._c.corrupt += 1
            return r

        self._run(keys, build=lambda i: (b"GET", keys[i]), read=read, write=False)
        self._count_gets(out)
        return out

    def read_each(self, items: Sequence[tuple[bytes, bytes]], use: Callable[[int, memoryview], bool], *,
                  limit: int) -> list[bool]:
        """Read values one by one into a per-thread scratch buffer and hand each to ``use(i, value)``.

        ``use`` runs while the next values are still arriving and must be done with the view when it
        returns; its verdict (True: a good value) is the item's flag. A value over ``limit`` bytes, or
        a reply that is not a value, is a miss counted as corrupt and deleted.

        Args:
            items: ``(fingerprint, key)`` per value.
            use: consumes value ``i``; returns whether it was good.
            limit: largest value accepted, in bytes.

        Returns:
            One flag per item: True where ``use`` accepted the value.
        """
        keys = [self.key(fp, k) for fp, k in items]
        ok = [False] * len(items)
        bad: list[int] = []

        def into(n: int) -> memoryview | None:
            if n > limit:
                return None
            buf = getattr(self._scratch, "buf", None)
            if buf is None or len(buf) < n:
                buf = self._scratch.buf = bytearray(n)
            return memoryview(buf)

        def read(rd: Any, i: int) -> Any:
            r = rd.reply(into)
            if isinstance(r, memoryview):
                ok[i] = bool(use(i, r))
                with self._lock:
                    self._c.bytes_out += r.nbytes
            elif r is _SKIPPED or isinstance(r, bytes):
                bad.append(i)
            return r

        self._run(keys, build=lambda i: (b"GET", keys[i]), read=read, write=False)
        self._count_gets(ok)
        if bad:
            self.drop_corrupt([items[i] for i in bad])
        return ok

    def drop_corrupt(self, items: Sequence[tuple[bytes, bytes]], *, delete: bool = True) -> None:
        """Count values that failed verification as corrupt and delete them (``delete``)."""
        if not items:
            return
        with self._lock:
            self._c.corrupt += len(items)
        log.warning("remote tier: %d corrupt or foreign values%s", len(items), " (deleted)" if delete else "")
        if delete:
            self.delete_many(items)

    def exists_many(self, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        """Which blocks the remote holds, in one round trip per batch (False everywhere while down).

        Presence is not validity: a present value may still fail verification when fetched.
        """
        keys = [self.key(fp, k) for fp, k in items]
        out = [False] * len(items)

        def read(rd: Any, i: int) -> Any:
            r = rd.reply()
            out[i] = r == 1
            return r

        self._run(keys, build=lambda i: (b"EXISTS", keys[i]), read=read, write=False,
                  max_batch=max(self.max_batch, 1024))
        with self._lock:
            self._c.exists += len(items)
        return out

    def prefix_len(self, fingerprint: bytes, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` of one namespace the remote holds (lookups of the uncached tail)."""
        have = self.exists_many([(fingerprint, k) for k in keys])
        return next((i for i, h in enumerate(have) if not h), len(have))

    def delete_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Delete blocks (UNLINK: the server frees memory in the background); returns keys deleted."""
        keys = [self.key(fp, k) for fp, k in items]
        n = [0]

        def read(rd: Any, i: int) -> Any:
            r = rd.reply()
            if isinstance(r, int):
                n[0] += r
            return r

        # An ACL without UNLINK only leaves bad values in place (they stay misses): not a reason to go down.
        self._run(keys, build=lambda i: (b"UNLINK", keys[i]), read=read, write=False, quiet=True,
                  max_batch=max(self.max_batch, 1024), key_errors=("NOPERM",))
        with self._lock:
            self._c.deletes += n[0]
        return n[0]

    def admit(self, *, uses: int, sharers: int = 0, pinned: bool = False) -> bool:
        """Whether a block should be written through, by the admission mode; counts the decision.

        Args:
            uses: times the block was used (its commit counts as one, each hit as one more).
            sharers: leases plus children holding it (a shared prefix).
            pinned: the block is pinned.
        """
        ok = (self.admission == "all" or pinned
              or (self.admission == "reused" and (uses >= 2 or sharers >= 2)))
        with self._lock:
            if ok:
                self._c.admitted += 1
            else:
                self._c.rejected += 1
        return ok

    def writable(self) -> bool:
        """Whether a put would be attempted now (False while down or read-only, until the next probe)."""
        now = time.monotonic()
        with self._lock:
            return (self._link.up or now >= self._link.until) and (self._writes.up or now >= self._writes.until)

    def ping(self) -> bool:
        """Probe the remote now if it is up or its backoff has passed; True when it answered.

        Cheap while down and not due (no network). The daemon may call this from a timer so that
        ``state()`` turns back to up without waiting for traffic.
        """
        res = self._run([b"tierkv:ping"], build=lambda i: (b"PING",), read=lambda rd, i: rd.reply(), write=False,
                        all_nodes=True)
        with self._lock:
            return res is not None and self._link.up

    def state(self) -> dict[str, Any]:
        """``{"state": "up" | "down" | "read-only", "reason", "retry_in_s", "last_error"}``."""
        now = time.monotonic()
        with self._lock:
            return self._state(now)

    def stats(self) -> dict[str, Any]:
        """State plus counters, for ``tierkv stats``: hits, misses, corrupt, puts, put_dropped, bytes_in
        (written to the remote), bytes_out (read from it), errors, trips, latency EMA of a round trip."""
        now = time.monotonic()
        with self._lock:
            d: dict[str, Any] = {"url": self.url, "cluster": self.cluster, "admission": self.admission,
                                 "ttl_s": self.ttl_ms / 1000 if self.ttl_ms else None}
            d.update(self._state(now))
            d.update(vars(self._c))
            d["latency_ema_ms"] = round(self._latency_ema * 1e3, 3)
            d["last_error_age_s"] = round(now - self._last_error_at, 1) if self._last_error_at else None
            return d

    def server_info(self) -> dict[str, Any] | None:
        """Memory figures of the server(s): used and max bytes, eviction policy, primaries; None if it
        cannot be asked (down, or the ACL denies INFO). Not on any hot path."""
        if not self._link.up:
            return None
        try:
            if self.cluster:
                rc = self._cluster_client()
                per = rc.info("memory", target_nodes=redis.RedisCluster.PRIMARIES)
                infos = list(per.values()) if isinstance(per, dict) and "used_memory" not in per else [per]
            else:
                infos = [redis.Redis(connection_pool=self._pool).info("memory")]
        except (RedisError, RedisClusterException, OSError) as exc:
            log.debug("remote tier: INFO memory failed: %s", exc)
            return None
        return {"used_bytes": sum(int(i.get("used_memory", 0)) for i in infos),
                "max_bytes": sum(int(i.get("maxmemory", 0)) for i in infos),
                "policy": str(infos[0].get("maxmemory_policy", "")) if infos else "",
                "nodes": len(infos)}

    def close(self) -> None:
        """Close every connection (later calls reconnect)."""
        if self._pool is not None:
            self._pool.disconnect()
        with self._topology_lock:
            if self._rc is not None:
                try:
                    self._rc.close()
                except Exception:  # closing a half-built cluster client must not fail a shutdown
                    pass
                self._rc = None

    def __enter__(self) -> RemoteTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------------
    def _state(self, now: float) -> dict[str, Any]:
        if not self._link.up:
            st, br = "down", self._link
        elif not self._writes.up:
            st, br = "read-only", self._writes
        else:
            st, br = "up", None
        return {"state": st, "reason": br.reason if br else "",
                "retry_in_s": round(max(0.0, br.until - now), 3) if br else 0.0, "last_error": self._last_error}

    def _count_gets(self, got: list) -> None:
        hits = sum(1 for g in got if g is not None and g is not False)
        with self._lock:
            self._c.gets += len(got)
            self._c.hits += hits
            self._c.misses += len(got) - hits

    def _groups(self, keys: list[bytes], all_nodes: bool) -> list[tuple[ConnectionPool, list[int]]]:
        if not self.cluster:
            assert self._pool is not None
            return [(self._pool, list(range(len(keys))))]
        rc = self._cluster_client()
        if all_nodes:
            return [(rc.get_redis_connection(n).connection_pool, [0]) for n in rc.get_primaries()]
        by: dict[str, tuple[Any, list[int]]] = {}
        for i, k in enumerate(keys):
            node = rc.get_node_from_key(k)
            by.setdefault(node.name, (node, []))[1].append(i)
        return [(rc.get_redis_connection(node).connection_pool, idxs) for node, idxs in by.values()]

    def _cluster_client(self) -> redis.RedisCluster:
        with self._topology_lock:
            if self._rc is None:
                from redis.cluster import ClusterNode

                (h0, p0), rest = self.target.seeds[0], self.target.seeds[1:]
                # Only the url= path of RedisCluster hands connection_class to the node pools; TLS settings
                # travel inside the class, so the URL stays redis://.
                self._rc = redis.RedisCluster(
                    url=f"redis://{h0}:{p0}", startup_nodes=[ClusterNode(h, p) for h, p in rest],
                    retry=Retry(NoBackoff(), 0), require_full_coverage=False, **self._cluster_opts)
                self._refresh = False
            elif self._refresh:
                self._refresh = False
                self._rc.nodes_manager.initialize()
            return self._rc

    def _reader(self, conn: Any) -> Any:
        sock = getattr(conn, "_sock", None)
        if self.fast_reads and sock is not None and hasattr(sock, "recv_into"):
            return _SocketReader(sock)
        return _ParserReader(conn)

    def _run(self, keys: list[bytes], build: Callable[[int], tuple], read: Callable[[Any, int], Any], *,
             write: bool, sizes: list[int] | None = None, max_batch: int | None = None, quiet: bool = False,
             all_nodes: bool = False, key_errors: tuple[str, ...] = ()) -> list | None:
        """Send one command per key, pipelined in batches, grouped by node; ``read(reader, i)`` consumes
        reply ``i``. Returns None (nothing sent) while the breaker refuses, else the replies (None for
        those of batches not sent after a failure). Remote failures are recorded, never raised."""
        if not keys:
            return []
        now = time.monotonic()
        with self._lock:
            if write and not self._writes.allow(now):
                return None
            if not self._link.allow(now):
                if write:
                    self._writes.release()
                return None
        replies: list[Any] = [None] * len(keys)
        per = max_batch or self.max_batch
        start = 0
        write_error = ""
        try:
            while start < len(keys):
                end, nbytes = start, 0
                while end < len(keys) and end - start < per and (end == start or sizes is None
                                                                 or nbytes + sizes[end] <= self.batch_bytes):
                    nbytes += sizes[end] if sizes else 0
                    end += 1
                t0 = time.perf_counter()
                self._round_trip(keys, start, end, build, read, replies, all_nodes)
                dt = time.perf_counter() - t0
                for r in replies[start:end]:
                    if isinstance(r, ReplyError):
                        scope, reason = ("key", r.code.lower()) if r.code in key_errors else _classify(r, write)
                        self._note_error(f"{reason}: {r[:200]}", quiet or scope == "key")
                        if scope == "link":
                            raise _ReplyFailure(reason)
                        if scope == "write":
                            write_error = reason
                        elif reason == "moved":
                            self._refresh = True
                with self._lock:
                    self._c.round_trips += 1
                    self._latency_ema = dt if not self._latency_ema else (
                        _EMA_ALPHA * dt + (1 - _EMA_ALPHA) * self._latency_ema)
                if write_error:
                    break  # the server refuses writes: the rest of this call would be refused too
                start = end
        except (RedisError, RedisClusterException, OSError, _ReplyFailure) as exc:
            reason = exc.reason if isinstance(exc, _ReplyFailure) else _reason_of(exc)
            if not isinstance(exc, _ReplyFailure):
                self._note_error(f"{reason}: {exc}", quiet)
            if self.cluster:
                self._refresh = True  # a failover moves slots: ask for the map again before the next try
            with self._lock:
                self._link.failure(time.monotonic(), reason)
                self._c.trips += 1
                if write:
                    self._writes.release()
            log.warning("remote tier %s is down (%s); retrying in %.1fs", self.url, reason,
                        self._link.until - time.monotonic())
            return replies
        except BaseException:
            with self._lock:
                self._link.release()
                if write:
                    self._writes.release()
            raise
        with self._lock:
            if self._link.success():
                self._c.recoveries += 1
                log.warning("remote tier %s is up again", self.url)
            if write:
                if write_error:
                    if self._writes.up:
                        self._c.trips += 1
                        log.warning("remote tier %s refuses writes (%s)", self.url, write_error)
                    self._writes.failure(time.monotonic(), write_error)
                elif self._writes.success():
                    self._c.recoveries += 1
                    log.warning("remote tier %s accepts writes again", self.url)
        return replies

    def _round_trip(self, keys: list[bytes], start: int, end: int, build: Callable[[int], tuple],
                    read: Callable[[Any, int], Any], replies: list, all_nodes: bool) -> None:
        """One pipelined batch: every node gets its commands before any reply is read."""
        groups = self._groups(keys[start:end], all_nodes)
        held: list[tuple[ConnectionPool, Any, list[int]]] = []
        try:
            for pool, idxs in groups:
                conn = pool.get_connection()
                held.append((pool, conn, idxs))
                conn.send_packed_command(conn.pack_commands([build(start + i) for i in idxs]), check_health=False)
            for _, conn, idxs in held:
                rd = self._reader(conn)
                for i in idxs:
                    replies[start + i] = read(rd, start + i)
                rd.finish()
        except BaseException:
            for _, conn, _ in held:
                conn.disconnect()  # the stream may be mid-reply: never reuse it
            raise
        finally:
            for pool, conn, _ in held:
                pool.release(conn)

    def _note_error(self, text: str, quiet: bool) -> None:
        with self._lock:
            self._c.errors += 1
            if not quiet:
                self._last_error = text
                self._last_error_at = time.monotonic()


class _ReplyFailure(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _classify(err: ReplyError, write: bool) -> tuple[str, str]:
    """(scope, reason) of an error reply: scope ``key`` (a miss), ``write`` (writes pause), ``link`` (down)."""
    code = err.code
    if code in ("MOVED", "ASK", "TRYAGAIN"):
        return "key", "moved"
    if code == "WRONGTYPE":
        return "key", "wrongtype"
    if code == "OOM":
        return ("write", "full") if write else ("link", "oom")
    if code in ("READONLY", "MISCONF"):
        return ("write" if write else "link"), code.lower()
    if code == "NOPERM":
        return ("write" if write else "link"), "denied"
    return "link", code.lower() or "error"


def _reason_of(exc: BaseException) -> str:
    if isinstance(exc, (redis.TimeoutError, TimeoutError)):
        return "timeout"
    if isinstance(exc, redis.AuthenticationError):
        return "auth"
    if isinstance(exc, (redis.ConnectionError, ConnectionError)):
        return "connection"
    if isinstance(exc, _Desync):
        return "protocol"
    return type(exc).__name__


def _flat(blob: Any) -> memoryview:
    """A flat byte view of an encoded block (no copy)."""
    try:
        mv = memoryview(blob)
    except TypeError:
        raise BadRequest("a blob must be a bytes-like object") from None
    if not mv.c_contiguous:
        raise BadRequest("a blob must be C-contiguous")
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")

"""Remote tier: block values in Redis or Valkey (standalone or cluster), shared by every node of a fleet.

A prefix computed on node A is a hit on node B: both sidecars read and write the same keys,
``tierkv:<namespace fingerprint hex>:<block key hex>`` (:func:`~tierkv.tiers.remote.url.remote_key`).
The tier stores and fetches bytes; the remote mover (``tierkv.movers.remote``) encodes blocks into
values and verifies what comes back, since every value read is untrusted.

Wire path. Commands are pipelined in batches (``max_batch`` keys or ``batch_bytes``, whichever comes
first); in a cluster the keys of a batch are grouped by the node that owns their slot, every node gets
its part before any reply is read, so the nodes work in parallel. Keys carry no hash tag: a tag per
namespace would put a whole model on one slot, so one node would hold it and serve every read of it.
Replies of our own pipelines are read straight from the connection's socket into the destination
buffer (:mod:`~tierkv.tiers.remote.resp`); where the socket is not reachable, or with
``fast_reads=False``, redis-py's parser reads them.

Failures. Connection errors, timeouts and server errors that are not about one key open the link
breaker; a full server, a write the ACL denies, a read-only replica or a failing ``bgsave`` open only
the write breaker (:mod:`~tierkv.tiers.remote.breaker`). Nothing here raises to the caller for a remote
failure; only caller misuse raises (``BadRequest``).

Threads. The class is thread-safe and every public method is blocking network I/O bounded by the socket
timeouts (each send and receive waits at most ``socket_timeout``; a failure ends the call at once).
Call it from transfer-engine worker threads, never while holding the block table's lock. Calls from
different threads use different pooled connections and run in parallel.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from redis.exceptions import RedisClusterException, RedisError

from tierkv.core.errors import BadRequest
from tierkv.tiers.remote.breaker import Breakers
from tierkv.tiers.remote.connection import Nodes, connection_options
from tierkv.tiers.remote.pipeline import Pipeline
from tierkv.tiers.remote.resp import SKIPPED
from tierkv.tiers.remote.settings import RemoteConfig
from tierkv.tiers.remote.url import KEY_PREFIX, parse_remote_url, redact_url, remote_key

log = logging.getLogger("tierkv.remote")

__all__ = ["RemoteTier"]



@dataclass
class _Counters:
    gets: int = 0            # keys asked for
    hits: int = 0
    misses: int = 0          # absent, skipped while down, or failed
    corrupt: int = 0         # values that failed verification (or were not strings)
    foreign: int = 0         # intact values of another namespace (identity) than their key's
    puts: int = 0            # values stored
    put_dropped: int = 0     # values not stored (down, full, denied, error)
    exists: int = 0          # keys probed with EXISTS
    deletes: int = 0         # keys deleted
    bytes_in: int = 0        # value bytes written to the remote
    bytes_out: int = 0       # value bytes read from the remote


class RemoteTier:
    """Block values in a shared Redis/Valkey, standalone or cluster.

    Args:
        url: see :class:`~tierkv.tiers.remote.settings.RemoteConfig`.
        username: ACL user; overrides the URL's.
        password: overrides the URL's.
        cluster: treat a ``redis://`` / ``rediss://`` URL as a cluster seed.
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
        codec: name of the codec the remote mover encodes this tier's values with.
        **redis_kwargs: extra redis-py connection settings (``ssl_ca_certs``, ``socket_keepalive``, ...).

    Nothing connects in the constructor: the first call does, so a daemon starts while its remote is down.

    Raises:
        ValueError: the URL or a setting is unusable.
    """

    def __init__(self, url: str, *, username: str | None = None, password: str | None = None, cluster: bool = False,
                 ttl_s: float | None = None, socket_timeout_s: float = 2.0, connect_timeout_s: float = 1.0,
                 max_batch: int = 16, batch_bytes: int = 32 << 20, backoff_s: float = 0.5,
                 max_backoff_s: float = 30.0, fast_reads: bool = True, max_value_bytes: int = 256 << 20,
                 key_prefix: bytes = KEY_PREFIX, codec: str = "lossless", **redis_kwargs: Any) -> None:
        target = parse_remote_url(url, cluster=cluster)
        if max_batch < 1 or batch_bytes < 1 or max_value_bytes < 1:
            raise ValueError("max_batch, batch_bytes and max_value_bytes must be >= 1")
        if not (socket_timeout_s > 0 and connect_timeout_s > 0 and backoff_s > 0 and max_backoff_s > 0):
            raise ValueError("timeouts and backoffs must be > 0")
        if ttl_s is not None and ttl_s < 0:
            raise ValueError("ttl_s must be >= 0")
        if not isinstance(key_prefix, bytes) or not key_prefix or b"{" in key_prefix:
            raise ValueError("key_prefix must be non-empty bytes without '{' (no hash tags)")
        self.target = target
        self.url = redact_url(url)
        self.cluster = target.cluster
        self.ttl_ms = int(ttl_s * 1000) if ttl_s else 0
        self.max_value_bytes = max_value_bytes
        self.key_prefix = key_prefix
        self.codec = codec
        self.socket_timeout_s = socket_timeout_s
        cls, opts = connection_options(target, username=username, password=password,
                                       socket_timeout_s=socket_timeout_s, connect_timeout_s=connect_timeout_s,
                                       extra=redis_kwargs)
        self._nodes = Nodes(target, cls, opts)
        self._breakers = Breakers(backoff_s, max_backoff_s)
        self._lock = self._breakers.lock
        self._pipe = Pipeline(self._nodes, self._breakers, url=self.url, max_batch=max_batch,
                              batch_bytes=batch_bytes, fast_reads=fast_reads)
        self._c = _Counters()
        self._scratch = threading.local()

    @classmethod
    def from_config(cls, cfg: RemoteConfig, **kwargs: Any) -> RemoteTier:
        """Build from a :class:`~tierkv.tiers.remote.settings.RemoteConfig` (``cfg.url`` must be set)."""
        cfg.validate()
        if not cfg.url:
            raise ValueError("remote.url is empty: no remote tier configured")
        return cls(cfg.url, username=cfg.username or None, password=cfg.password or None, cluster=cfg.cluster,
                   ttl_s=cfg.ttl_s or None, socket_timeout_s=cfg.socket_timeout_s,
                   connect_timeout_s=cfg.connect_timeout_s, max_batch=cfg.max_batch, batch_bytes=cfg.batch_bytes,
                   backoff_s=cfg.backoff_s, max_backoff_s=cfg.max_backoff_s, codec=cfg.codec, **kwargs)

    @property
    def max_batch(self) -> int:
        """Most keys in one pipelined round trip."""
        return self._pipe.max_batch

    @property
    def batch_bytes(self) -> int:
        """Most value bytes sent in one round trip."""
        return self._pipe.batch_bytes

    # ---- values -------------------------------------------------------------------------------------
    def key(self, fingerprint: bytes, key: bytes) -> bytes:
        """The Redis key of a block (see :func:`~tierkv.tiers.remote.url.remote_key`)."""
        return remote_key(fingerprint, key, self.key_prefix)

    def put_many(self, items: Sequence[tuple[bytes, bytes, Any]]) -> list[bool]:
        """Store values (write-through); ``True`` where the value was stored.

        Args:
            items: ``(fingerprint, key, blob)``; ``blob`` is bytes-like (bytes, memoryview, numpy array);
                it is sent without a copy and must stay unchanged until the call returns.

        Returns:
            One flag per item; False where the value was dropped (tier down or read-only, server full,
            ACL denial, error). Never raises for a remote failure.
        """
        keys = [self.key(fp, k) for fp, k, _ in items]
        blobs = [_flat(b) for _, _, b in items]
        ttl = (b"PX", b"%d" % self.ttl_ms) if self.ttl_ms else ()
        out = [False] * len(items)

        def read(rd: Any, i: int) -> Any:
            r = rd.reply()
            if r == b"OK":
                out[i] = True
                with self._lock:
                    self._c.puts += 1
                    self._c.bytes_in += blobs[i].nbytes
            return r

        self._pipe.run(keys, lambda i: (b"SET", keys[i], blobs[i], *ttl), read, write=True,
                  sizes=[b.nbytes for b in blobs])
        self.count_dropped(out.count(False))
        return out

    def count_dropped(self, n: int) -> None:
        """Count ``n`` values not stored (also those a caller did not send once the tier went down)."""
        with self._lock:
            self._c.put_dropped += n

    def get_many(self, items: Sequence[tuple[bytes, bytes]]) -> list[memoryview | None]:
        """Raw (unverified) values; None where absent, over ``max_value_bytes``, or the tier is down.

        Each value is its own writable buffer (a memoryview of a uint8 array).
        """
        keys = [self.key(fp, k) for fp, k in items]
        out: list[memoryview | None] = [None] * len(items)
        limit = self.max_value_bytes

        def into(n: int) -> memoryview | None:
            # np.empty: no zero-fill pass over a buffer the value overwrites anyway (bytearray(n) has one).
            # numpy's stubs declare ndarray's buffer protocol for Python 3.12+ only.
            return memoryview(np.empty(n, np.uint8)) if n <= limit else None  # type: ignore[arg-type]

        def read(rd: Any, i: int) -> Any:
            r = rd.reply(into)
            if isinstance(r, memoryview):
                out[i] = r
                with self._lock:
                    self._c.bytes_out += r.nbytes
            elif r is SKIPPED or isinstance(r, bytes):  # too big, or a status reply where a value belongs
                with self._lock:
                    self._c.corrupt += 1
            return r

        self._pipe.run(keys, lambda i: (b"GET", keys[i]), read, write=False)
        self._count_gets(out)
        return out

    def read_each(self, items: Sequence[tuple[bytes, bytes]], use: Callable[[int, memoryview], bool], *,
                  limit: int) -> list[bool]:
        """Read values one by one into a per-thread scratch buffer and hand each to ``use(i, value)``.

        ``use`` runs while the next values are still arriving and must be done with the view when it
        returns; its verdict (True: a good value) is the item's flag. A value over ``limit`` bytes, or a
        reply that is not a value, is a miss counted as corrupt and deleted.

        Args:
            items: ``(fingerprint, key)`` per value.
            use: consumes value ``i``; returns whether it was good.
            limit: largest value accepted, in bytes.
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
            elif r is SKIPPED or isinstance(r, bytes):
                bad.append(i)
            return r

        self._pipe.run(keys, lambda i: (b"GET", keys[i]), read, write=False)
        self._count_gets(ok)
        self.drop_corrupt([items[i] for i in bad])
        return ok

    def drop_corrupt(self, items: Sequence[tuple[bytes, bytes]], *, delete: bool = True, foreign: int = 0) -> None:
        """Count values that failed verification (``foreign`` of them intact values of another namespace,
        the rest corrupt) and delete them (``delete``)."""
        if not items:
            return
        with self._lock:
            self._c.corrupt += len(items) - foreign
            self._c.foreign += foreign
        log.warning("remote tier: %d corrupt and %d foreign values%s", len(items) - foreign, foreign,
                    " (deleted)" if delete else "")
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

        self._pipe.run(keys, lambda i: (b"EXISTS", keys[i]), read, write=False, max_batch=max(self.max_batch, 1024))
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
        self._pipe.run(keys, lambda i: (b"UNLINK", keys[i]), read, write=False, quiet=True,
                  max_batch=max(self.max_batch, 1024), key_errors=("NOPERM",))
        with self._lock:
            self._c.deletes += n[0]
        return n[0]

    # ---- health ---------------------------------------------------------------------------------------
    def writable(self) -> bool:
        """Whether a put would be attempted now (False while down or read-only, until the next probe)."""
        with self._lock:
            return self._breakers.writable(time.monotonic())

    def ping(self) -> bool:
        """Probe the remote now if it is up or its backoff has passed; True when it answered.

        Cheap while down and not due (no network). The daemon may call this from a timer so that
        ``state()`` turns back to up without waiting for traffic.
        """
        res = self._pipe.run([b"tierkv:ping"], lambda i: (b"PING",), lambda rd, i: rd.reply(), write=False,
                        all_nodes=True)
        with self._lock:
            return res is not None and self._breakers.link.up

    def state(self) -> dict[str, Any]:
        """``{"state": "up" | "down" | "read-only", "reason", "retry_in_s", "last_error"}``."""
        with self._lock:
            return {**self._breakers.state(time.monotonic()), "last_error": self._pipe.last_error}

    def stats(self) -> dict[str, Any]:
        """State plus counters, for ``tierkv stats``: hits, misses, corrupt, puts, put_dropped, bytes_in
        (written to the remote), bytes_out (read from it), errors, trips, latency EMA of a round trip."""
        now = time.monotonic()
        with self._lock:
            d: dict[str, Any] = {"url": self.url, "cluster": self.cluster,
                                 "ttl_s": self.ttl_ms / 1000 if self.ttl_ms else None}
            p = self._pipe
            d.update(self._breakers.state(now), last_error=p.last_error)
            d.update(vars(self._c), errors=p.errors, trips=self._breakers.trips, recoveries=self._breakers.recoveries,
                     round_trips=p.round_trips)
            d["latency_ema_ms"] = round(p.latency_ema * 1e3, 3)
            d["last_error_age_s"] = round(now - p.last_error_at, 1) if p.last_error_at else None
            return d

    def server_info(self) -> dict[str, Any] | None:
        """Memory figures of the server(s): used and max bytes, eviction policy, primaries; None if it
        cannot be asked (down, or the ACL denies INFO). Not on any hot path."""
        if not self._breakers.link.up:
            return None
        try:
            infos = self._nodes.memory_info()
        except (RedisError, RedisClusterException, OSError) as exc:
            log.debug("remote tier: INFO memory failed: %s", exc)
            return None
        return {"used_bytes": sum(int(i.get("used_memory", 0)) for i in infos),
                "max_bytes": sum(int(i.get("maxmemory", 0)) for i in infos),
                "policy": str(infos[0].get("maxmemory_policy", "")) if infos else "",
                "nodes": len(infos)}

    def close(self) -> None:
        """Close every connection (later calls reconnect)."""
        self._nodes.close()

    def __enter__(self) -> RemoteTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _count_gets(self, got: list) -> None:
        hits = sum(1 for g in got if g is not None and g is not False)
        with self._lock:
            self._c.gets += len(got)
            self._c.hits += hits
            self._c.misses += len(got) - hits

def _flat(blob: Any) -> memoryview:
    """A flat byte view of a value (no copy)."""
    try:
        mv = memoryview(blob)
    except TypeError:
        raise BadRequest("a blob must be a bytes-like object") from None
    if not mv.c_contiguous:
        raise BadRequest("a blob must be C-contiguous")
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")

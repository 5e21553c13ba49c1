"""Pipelined round trips of the remote tier, and what their failures do to its breakers.

Commands are sent in batches (``max_batch`` keys or ``batch_bytes``, whichever comes first); in a
cluster the keys of a batch are grouped by the node that owns their slot, and every node gets its part
before any reply is read, so the nodes work in parallel. Replies are read straight from the
connection's socket (:class:`~tierkv.tiers.remote.resp.SocketReader`), or through redis-py's parser
where the socket is not reachable or with ``fast_reads=False``. Connection errors, timeouts and error
replies are recorded and open a breaker; they are never raised.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisClusterException, RedisError

from tierkv.tiers.remote.breaker import Breakers, classify, reason_of
from tierkv.tiers.remote.connection import Nodes
from tierkv.tiers.remote.resp import ParserReader, ReplyError, SocketReader

log = logging.getLogger("tierkv.remote")

__all__ = ["Pipeline", "Read"]

_EMA_ALPHA = 0.2
_EVENT_TEXT = {"up": "is up again", "accepts writes": "accepts writes again"}
Read = Callable[[Any, int], Any]


class _LinkDown(Exception):
    """An error reply that takes the link down (the stream itself is still in sync)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Pipeline:
    """Round trips to the nodes of one remote, guarded by its breakers.

    Args:
        nodes: the pools of the remote's nodes.
        breakers: the tier's breakers; their lock also guards this object's counters.
        url: the redacted URL, for the log.
        max_batch: most keys in one round trip.
        batch_bytes: most value bytes sent in one round trip.
        fast_reads: read replies from the socket (False: redis-py's parser).
    """

    def __init__(self, nodes: Nodes, breakers: Breakers, *, url: str, max_batch: int, batch_bytes: int,
                 fast_reads: bool) -> None:
        self.nodes = nodes
        self.breakers = breakers
        self.url = url
        self.max_batch = max_batch
        self.batch_bytes = batch_bytes
        self.fast_reads = fast_reads
        self._lock = breakers.lock
        self.errors = 0           # failed round trips and error replies
        self.round_trips = 0
        self.latency_ema = 0.0    # seconds of one round trip
        self.last_error = ""
        self.last_error_at = 0.0

    def run(self, keys: list[bytes], build: Callable[[int], tuple], read: Read, *, write: bool,
             sizes: list[int] | None = None, max_batch: int | None = None, quiet: bool = False,
             all_nodes: bool = False, key_errors: tuple[str, ...] = ()) -> list | None:
        """Send one command per key, pipelined in batches, grouped by node; ``read(reader, i)`` consumes
        reply ``i``. Returns None (nothing sent) while the breaker refuses, else the replies (None for
        those of batches not sent after a failure). Remote failures are recorded, never raised."""
        if not keys:
            return []
        with self._lock:
            if not self.breakers.allow(time.monotonic(), write):
                return None
        replies: list[Any] = [None] * len(keys)
        try:
            write_error = self._batches(keys, build, read, replies, write=write, sizes=sizes,
                                        per=max_batch or self.max_batch, quiet=quiet, all_nodes=all_nodes,
                                        key_errors=key_errors)
        except (RedisError, RedisClusterException, OSError, _LinkDown) as exc:
            self._link_failed(exc, write, quiet)
            return replies
        except BaseException:
            with self._lock:
                self.breakers.release(write)
            raise
        with self._lock:
            events = self.breakers.succeeded(time.monotonic(), write, write_error)
        for e in events:
            log.warning("remote tier %s %s", self.url, f"refuses writes ({write_error})" if e == "refuses writes"
                        else _EVENT_TEXT[e])
        return replies

    def _batches(self, keys: list[bytes], build: Callable[[int], tuple], read: Read, replies: list, *,
                 write: bool, sizes: list[int] | None, per: int, quiet: bool, all_nodes: bool,
                 key_errors: tuple[str, ...]) -> str:
        """Round trips of at most ``per`` keys (and ``batch_bytes``); returns why writes were refused."""
        start = 0
        while start < len(keys):
            end, nbytes = start, 0
            while end < len(keys) and end - start < per and (end == start or sizes is None
                                                             or nbytes + sizes[end] <= self.batch_bytes):
                nbytes += sizes[end] if sizes else 0
                end += 1
            t0 = time.perf_counter()
            self._round_trip(keys, start, end, build, read, replies, all_nodes)
            dt = time.perf_counter() - t0
            write_error = self._check_replies(replies[start:end], write, quiet, key_errors)
            with self._lock:
                self.round_trips += 1
                self.latency_ema = dt if not self.latency_ema else (
                    _EMA_ALPHA * dt + (1 - _EMA_ALPHA) * self.latency_ema)
            if write_error:
                return write_error  # the server refuses writes: the rest of this call would be refused too
            start = end
        return ""

    def _check_replies(self, replies: list, write: bool, quiet: bool, key_errors: tuple[str, ...]) -> str:
        """Record the error replies of a batch; raise for one that takes the link down, else return why
        writes were refused ("" if they were not)."""
        write_error = ""
        for r in replies:
            if isinstance(r, ReplyError):
                scope, reason = ("key", r.code.lower()) if r.code in key_errors else classify(r.code, write)
                self._note_error(f"{reason}: {r[:200]}", quiet or scope == "key")
                if scope == "link":
                    raise _LinkDown(reason)
                if scope == "write":
                    write_error = reason
                elif reason == "moved":
                    self.nodes.stale = True
        return write_error

    def _link_failed(self, exc: BaseException, write: bool, quiet: bool) -> None:
        reason = exc.reason if isinstance(exc, _LinkDown) else reason_of(exc)
        if not isinstance(exc, _LinkDown):
            self._note_error(f"{reason}: {exc}", quiet)
        if self.nodes.cluster:
            self.nodes.stale = True  # a failover moves slots: ask for the map again before the next try
        with self._lock:
            self.breakers.link_failed(time.monotonic(), reason, write)
            retry = self.breakers.link.until - time.monotonic()
        log.warning("remote tier %s is down (%s); retrying in %.1fs", self.url, reason, retry)

    def _round_trip(self, keys: list[bytes], start: int, end: int, build: Callable[[int], tuple], read: Read,
                    replies: list, all_nodes: bool) -> None:
        """One pipelined batch: every node gets its commands before any reply is read."""
        groups = self.nodes.groups(keys[start:end], all_nodes)
        held: list[tuple[Any, Any, list[int]]] = []
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

    def _reader(self, conn: Any) -> SocketReader | ParserReader:
        sock = getattr(conn, "_sock", None)
        if self.fast_reads and sock is not None and hasattr(sock, "recv_into"):
            return SocketReader(sock)
        return ParserReader(conn)

    def _note_error(self, text: str, quiet: bool) -> None:
        with self._lock:
            self.errors += 1
            if not quiet:
                self.last_error = text
                self.last_error_at = time.monotonic()



"""Connections of the remote tier: redis-py's, with a zero-copy packer, pooled per node.

Values go out through redis-py's pure-Python packer, which passes memoryviews and large bytes to
``sendall`` as they are (the default hiredis packer copies each value twice). Connections are otherwise
redis-py's (connect, AUTH, TLS, SELECT, timeouts), in RESP2 so that the server never sends anything
unasked. :class:`Nodes` holds the one pool of a standalone server, or the cluster client whose node
pools serve the keys of each slot.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

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
)
from redis.retry import Retry

from tierkv.tiers.remote.url import Target

__all__ = ["Nodes", "TcpConnection", "TlsConnection", "UnixConnection", "connection_options"]

# One packer for every connection: it only holds settings. Large values and memoryviews are passed to
# sendall untouched; small arguments are joined into one buffer.
_PACKER = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
# No CLIENT SETINFO on connect: two round trips less per connection, and no ACL rule needed for it.
_NO_DRIVER_INFO = ({"driver_info": None} if "driver_info" in inspect.signature(AbstractConnection.__init__).parameters
                   else {"lib_name": None, "lib_version": None})


class _ZeroCopy:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["command_packer"] = _PACKER
        super().__init__(*args, **kwargs)


class TcpConnection(_ZeroCopy, Connection):
    """redis-py TCP connection with the zero-copy packer."""


class TlsConnection(_ZeroCopy, SSLConnection):
    """redis-py TLS connection with the zero-copy packer."""


class UnixConnection(_ZeroCopy, UnixDomainSocketConnection):
    """redis-py Unix-socket connection with the zero-copy packer."""


_OURS = {Connection: TcpConnection, SSLConnection: TlsConnection, UnixDomainSocketConnection: UnixConnection}


def connection_options(target: Target, *, username: str | None, password: str | None, socket_timeout_s: float,
                       connect_timeout_s: float, extra: dict[str, Any]) -> tuple[type, dict[str, Any]]:
    """The connection class and redis-py settings of a target (credentials override the URL's)."""
    opts = dict(target.options)
    cls = _OURS.get(opts.pop("connection_class", Connection), TcpConnection)
    if username:
        opts["username"] = username
    if password:
        opts["password"] = password
    opts.update(socket_timeout=socket_timeout_s, socket_connect_timeout=connect_timeout_s, protocol=2,
                health_check_interval=0, **_NO_DRIVER_INFO)
    if cls is not UnixConnection:
        opts["socket_keepalive"] = True  # a dead peer is noticed on idle pooled connections
    opts.update(extra)
    return cls, opts


class Nodes:
    """The pools that serve a target's keys: one for a standalone server, one per primary of a cluster.

    Args:
        target: where to connect.
        cls: connection class (see :func:`connection_options`).
        opts: redis-py connection settings.

    Nothing connects here: the first round trip does.

    Raises:
        ValueError: a setting redis-py's connection does not take.
    """

    def __init__(self, target: Target, cls: type, opts: dict[str, Any]) -> None:
        try:  # a connection object only holds settings until it connects: a bad one fails here, not later
            cls(**opts)
        except TypeError as exc:
            raise ValueError(f"unknown redis connection setting: {exc}") from None
        self.target = target
        self.cluster = target.cluster
        self.stale = False  # set after a failover or MOVED: the slot map is asked again before the next use
        self._lock = threading.Lock()
        self._rc: redis.RedisCluster | None = None
        self._pool: ConnectionPool | None = None
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

    def groups(self, keys: list[bytes], all_nodes: bool = False) -> list[tuple[ConnectionPool, list[int]]]:
        """The pool of each node and the indexes of ``keys`` it owns (every primary once: ``all_nodes``)."""
        if not self.cluster:
            assert self._pool is not None
            return [(self._pool, list(range(len(keys))))]
        rc = self._client()
        if all_nodes:
            return [(rc.get_redis_connection(n).connection_pool, [0]) for n in rc.get_primaries()]
        by: dict[str, tuple[Any, list[int]]] = {}
        for i, k in enumerate(keys):
            node = rc.get_node_from_key(k)
            by.setdefault(node.name, (node, []))[1].append(i)
        return [(rc.get_redis_connection(node).connection_pool, idxs) for node, idxs in by.values()]

    def memory_info(self) -> list[dict[str, Any]]:
        """``INFO memory`` of every primary.

        Raises:
            RedisError, RedisClusterException, OSError: the server could not be asked.
        """
        if not self.cluster:
            return [redis.Redis(connection_pool=self._pool).info("memory")]
        per = self._client().info("memory", target_nodes=redis.RedisCluster.PRIMARIES)
        return list(per.values()) if isinstance(per, dict) and "used_memory" not in per else [per]

    def close(self) -> None:
        """Close every connection (later calls reconnect)."""
        if self._pool is not None:
            self._pool.disconnect()
        with self._lock:
            if self._rc is not None:
                try:
                    self._rc.close()
                except Exception:  # closing a half-built cluster client must not fail a shutdown
                    pass
                self._rc = None

    def _client(self) -> redis.RedisCluster:
        with self._lock:
            if self._rc is None:
                from redis.cluster import ClusterNode

                (h0, p0), rest = self.target.seeds[0], self.target.seeds[1:]
                # Only the url= path of RedisCluster hands connection_class to the node pools; TLS settings
                # travel inside the class, so the URL stays redis://.
                self._rc = redis.RedisCluster(
                    url=f"redis://{h0}:{p0}", startup_nodes=[ClusterNode(h, p) for h, p in rest],
                    retry=Retry(NoBackoff(), 0), require_full_coverage=False, **self._cluster_opts)
                self.stale = False
            elif self.stale:
                self.stale = False
                self._rc.nodes_manager.initialize()
            return self._rc

"""Settings of the remote tier (the ``[remote]`` section of the daemon's config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tierkv.tiers.remote.url import parse_remote_url

__all__ = ["ADMISSION_MODES", "RemoteConfig"]

ADMISSION_MODES = ("all", "reused", "pinned")


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
    """Codec of blocks encoded for the remote tier (a block the disk tier holds in this codec is sent as
    the disk stores it)."""
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

    def validate(self, codecs: tuple[str, ...] | list[str] | None = None) -> None:
        """Raise ``ValueError`` naming the first bad setting.

        Args:
            codecs: the codec names to accept for ``codec`` (the daemon passes the registry's); None
                checks only that one is named.
        """
        if self.url:
            parse_remote_url(self.url, cluster=self.cluster)
        if self.admission not in ADMISSION_MODES:
            raise ValueError(f"remote.admission must be one of {', '.join(ADMISSION_MODES)}")
        if not isinstance(self.codec, str) or not self.codec:
            raise ValueError("remote.codec must name a codec")
        if codecs is not None and self.codec not in codecs:
            raise ValueError(f"remote.codec: unknown codec {self.codec!r} (known: {', '.join(codecs)})")
        for name in ("socket_timeout_s", "connect_timeout_s", "backoff_s", "max_backoff_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"remote.{name} must be > 0")
        if self.ttl_s < 0:
            raise ValueError("remote.ttl_s must be >= 0")
        if self.max_batch < 1 or self.batch_bytes < 1:
            raise ValueError("remote.max_batch and remote.batch_bytes must be >= 1")

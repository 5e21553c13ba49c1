"""Errors raised by tierkv: one root, a few specific kinds.

Caller misuse that is detected locally (wrong shape, bad argument) raises ``ValueError`` subclasses
of :class:`TierKVError` so that one ``except TierKVError`` catches everything tierkv raises.
"""

from __future__ import annotations


class TierKVError(Exception):
    """Root of every error tierkv raises."""

    code = "error"


class BadRequest(TierKVError, ValueError):
    """The request was malformed: wrong shape, dtype, size, unknown namespace or key."""

    code = "bad_request"


class ProtocolError(TierKVError):
    """A frame could not be parsed or broke the protocol; the connection is closed."""

    code = "protocol"


class KeyMissing(TierKVError, KeyError):
    """A requested block is not cached in any tier."""

    code = "missing"

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "key missing"


class TierFull(TierKVError):
    """A tier has no room and nothing could be evicted in time."""

    code = "full"


class Busy(TierKVError):
    """The daemon is overloaded or shutting down; try again later."""

    code = "busy"


class ConnectionFailed(TierKVError, ConnectionError):
    """The daemon could not be reached or the connection broke."""

    code = "connection"


class PermissionDenied(TierKVError, PermissionError):
    """The peer or path failed a security check."""

    code = "permission"


_BY_CODE = {cls.code: cls for cls in (TierKVError, BadRequest, ProtocolError, KeyMissing, TierFull, Busy,
                                      ConnectionFailed, PermissionDenied)}


def error_from_code(code: str, message: str) -> TierKVError:
    """Rebuild the exception a daemon reply names (unknown codes map to the root class)."""
    return _BY_CODE.get(code, TierKVError)(message)

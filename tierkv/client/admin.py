"""The admin client: one control request (stats, ping, health, tune, config, verify) without a namespace.

The CLI, the operator commands and the tests all speak to the daemon through :func:`request`.
"""

from __future__ import annotations

import socket as _socket

from tierkv.core import protocol
from tierkv.core.errors import ConnectionFailed, error_from_code
from tierkv.core.paths import default_socket


def request(socket: str | None, op: str, body: dict | None = None, timeout: float | None = 10.0) -> dict:
    """Send one control request and return the daemon's reply.

    Args:
        socket: the daemon's socket path (``None``: the default socket).
        op: an opcode name of :class:`tierkv.core.protocol.Op`, e.g. ``"STATS"``.
        body: the request body.
        timeout: seconds to wait for the reply (``None``: no limit).

    Returns:
        The reply body. A failed request raises the daemon's error as a :class:`TierKVError`.
    """
    path = socket or default_socket()
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        s.sendall(protocol.pack(protocol.Op[op], 1, body or {}))
        _op, status, _rid, reply = protocol.recv_frame(s)
    except TimeoutError:
        raise ConnectionFailed(f"no reply from tierkv at {path} within {timeout:g} s") from None
    except OSError as exc:
        raise ConnectionFailed(f"cannot reach tierkv at {path}: {exc.strerror or exc}") from None
    finally:
        s.close()
    if status != protocol.STATUS_OK:
        raise error_from_code(reply.get("code", ""), reply.get("message", "request failed"))
    return reply

"""The HELLO exchange that opens a client connection: a namespace out, the shared pools' fds back."""

from __future__ import annotations

import os
import socket

from tierkv.core import protocol
from tierkv.core.errors import ConnectionFailed, error_from_code
from tierkv.core.keys import Namespace
from tierkv.core.protocol import Op


def hello(path: str, ns: Namespace, timeout: float) -> tuple[socket.socket, dict, list[int]]:
    """Connect to the daemon at ``path`` and register ``ns``.

    Returns:
        The connected socket, the HELLO reply, and the fds it carried: the host pool, then the GPU
        stand-in pool when the daemon has one, then the lookup index when it has one.

    Raises:
        ConnectionFailed: no daemon answers, it closed the connection, or it passed the wrong fds.
        TierKVError: the daemon refused the namespace (its error, e.g. BadRequest).
    """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
    except OSError as exc:
        s.close()
        raise ConnectionFailed(f"cannot reach tierkv at {path}: {exc.strerror or exc}") from None
    s.settimeout(None)
    try:
        s.sendall(protocol.pack(Op.HELLO, 1, {"namespace": ns.to_dict()}))
        _op, status, _rid, body, fds = protocol.recv_frame_with_fds(s)
    except (OSError, ConnectionError) as exc:
        s.close()
        raise ConnectionFailed(f"tierkv at {path} closed the connection: {exc}") from None
    if status != protocol.STATUS_OK:
        _close_all(s, fds)
        raise error_from_code(body.get("code", ""), body.get("message", "hello refused"))
    gpu = body.get("gpu")
    standin = gpu is not None and gpu.get("kind") == "standin"
    if len(fds) != 1 + standin + (body.get("lookup_index") is not None):
        _close_all(s, fds)
        raise ConnectionFailed("daemon did not pass its shared-memory pools")
    return s, body, fds


def _close_all(s: socket.socket, fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
    s.close()

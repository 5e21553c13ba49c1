"""A client's connection to the daemon: the socket, its request/reply calls, and the mapped pools.

Bulk data never crosses the socket. At connect the daemon passes its pool (a memfd) with SCM_RIGHTS;
the connection maps it once, and slots are read and written in place. The socket carries small,
batched control frames, one request at a time.
"""

from __future__ import annotations

import mmap
import os
import socket
import threading
from typing import Any, Self

import torch

from tierkv.client.device import MappedDevicePool
from tierkv.client.handshake import hello
from tierkv.core import protocol
from tierkv.core.errors import BadRequest, ConnectionFailed, TierKVError, error_from_code
from tierkv.core.keys import Namespace
from tierkv.core.layout import Layout
from tierkv.core.lookup_index import ClientIndex
from tierkv.core.lookup_index import available as lookup_index_available
from tierkv.core.paths import default_socket
from tierkv.core.protocol import Op


class Connection:
    """A connection to the tierkv daemon for one model namespace. Thread-safe (calls are serialised)."""

    def __init__(self, sock: socket.socket, ns: Namespace, pool_fd: int, pool_bytes: int, fingerprint: bytes,
                 socket_path: str, populate: bool = True, gpu: dict | None = None, gpu_fd: int | None = None,
                 index: dict | None = None, index_fd: int | None = None, use_index: bool = True) -> None:
        self._sock = sock
        self._index: ClientIndex | None = None
        self.namespace = ns
        self.layout = ns.layout
        self.fingerprint = fingerprint
        self.socket_path = socket_path
        self._lock = threading.Lock()
        self._rid = 0
        try:
            # MAP_POPULATE maps every page now, so the hot path takes no page faults on first touch.
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self._mm = mmap.mmap(pool_fd, pool_bytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(pool_fd)  # the mapping keeps the memory alive
        self._pool = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._pool_bytes = pool_bytes
        self._gpu: MappedDevicePool | None = None
        if gpu is not None:
            self._gpu = MappedDevicePool(gpu, gpu_fd)
        elif gpu_fd is not None:
            os.close(gpu_fd)
        if index_fd is not None:
            if use_index and lookup_index_available():
                self._index = ClientIndex(index_fd, bool((index or {}).get("remote")))
            else:  # not wanted, or installed without the extension: lookups go through the socket
                os.close(index_fd)
        self._tickets: dict[int, str] = {}  # fetch tickets -> the tier their lease will be in
        self._reader = protocol.FrameReader(sock)
        self._closed = False

    # ---- connection -------------------------------------------------------------------------------
    @classmethod
    def connect(cls, socket: str | os.PathLike | None = None, *, model: str, layout: Layout, tp_rank: int = 0,
                tp_size: int = 1, timeout: float = 10.0, populate: bool = True, lookup_index: bool = True,
                identity: str = "") -> Self:
        """Connect to the daemon and register the namespace.

        Args:
            socket: the daemon's socket path (default: ``$TIERKV_SOCKET`` or the daemon's default).
            model: model id: a readable label; without ``identity`` it is also what keeps blocks apart.
            layout: the model's KV geometry.
            tp_rank: tensor-parallel rank of this engine process.
            tp_size: tensor-parallel world size.
            timeout: seconds to wait for the connection.
            populate: map every page of the pool at connect (no page faults later).
            lookup_index: answer :meth:`lookup` from the daemon's shared lookup index (False: always ask
                the daemon through the socket).
            identity: the model's identity (:func:`tierkv.client.identity.model_identity`): blocks are
                shared with every engine of the same identity, whatever its model id, and with no other.
                Empty: the model id alone asserts which weights these are.

        Raises:
            ConnectionFailed: no daemon answers at that path.
            BadRequest: the namespace was refused.
        """
        if not isinstance(layout, Layout):
            raise BadRequest("layout must be a tierkv.Layout")
        try:
            ns = Namespace(model, layout, tp_rank, tp_size, identity=identity)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        path = str(socket or default_socket())
        s, body, fds = hello(path, ns, timeout)
        gpu, index = body.get("gpu"), body.get("lookup_index")
        standin = gpu is not None and gpu.get("kind") == "standin"
        try:
            return cls(s, ns, fds[0], int(body["pool_bytes"]), bytes(body["fingerprint"]), path, populate,
                       gpu=gpu, gpu_fd=fds[1] if standin else None, index=index,
                       index_fd=fds[-1] if index is not None else None, use_index=lookup_index)
        except Exception as exc:
            s.close()
            raise ConnectionFailed(f"cannot map tierkv's memory pools: {exc}") from None

    def close(self) -> None:
        """Close the connection; the daemon releases every lease and slot this client held."""
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.close()
        finally:
            self._pool = torch.empty(0, dtype=torch.uint8)
            try:
                self._mm.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes with the last reference
            if self._gpu is not None:
                self._gpu.close()
            if self._index is not None:
                self._index.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, op: Op, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._closed:
                raise ConnectionFailed("client is closed")
            self._rid = (self._rid + 1) & 0xFFFFFFFF
            try:
                self._sock.sendall(protocol.pack(op, self._rid, body))
                rop, status, rid, reply = self._reader.read()
            except (OSError, ConnectionError) as exc:
                raise ConnectionFailed(f"connection to tierkv lost: {exc}") from None
        if status != protocol.STATUS_OK:
            reply = reply or {}
            raise error_from_code(str(reply.get("code", "")), str(reply.get("message", "request failed")))
        if rid != self._rid or rop != op:
            raise TierKVError("reply does not match the request (protocol desynchronised)")
        return reply or {}

    def _view(self, offset: int, tier: str = "host") -> torch.Tensor:
        n = self.layout.block_bytes
        flat = self._gpu.view(offset, n) if tier == "gpu" and self._gpu is not None else self._pool[offset:offset + n]
        return flat.view(self.layout.torch_dtype).view(self.layout.block_shape)

    @property
    def gpu_device(self) -> str | None:
        """The torch device of GPU-tier views (``"cuda:N"``, or ``"cpu"`` for the CPU stand-in), or None
        when the daemon runs without a GPU tier."""
        return None if self._gpu is None else self._gpu.device

    def _pick_tier(self, tier: str | None, tensor: Any) -> str:
        if tier is None:  # device tensors go through the GPU tier when the daemon has a real one
            is_dev = isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda"
            return "gpu" if is_dev and self._gpu is not None and self._gpu.kind == "cuda" else "host"
        if tier not in ("host", "gpu"):
            raise BadRequest(f"tier must be 'host' or 'gpu', got {tier!r}")
        if tier == "gpu" and self._gpu is None:
            raise BadRequest("the daemon runs without a GPU tier (start it with --gpu-capacity)")
        return tier

    def _device(self, tier: str) -> str:
        return self._gpu.device if tier == "gpu" and self._gpu is not None else "cpu"

    def _check_alive(self) -> None:
        """Raise ConnectionFailed if the daemon is gone (an index answer must not outlive it)."""
        with self._lock:
            if self._closed:
                raise ConnectionFailed("client is closed")
            try:
                eof = self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                return  # nothing to read: the connection is up
            except OSError as exc:
                raise ConnectionFailed(f"connection to tierkv lost: {exc}") from None
        if eof:
            raise ConnectionFailed("connection to tierkv lost: the daemon closed it")

"""Client library for an inference loop: a convenience layer (put/get) and a zero-copy layer
(alloc/commit, acquire/release) over the daemon's shared-memory host pool.

Bulk data never crosses the socket. At connect the daemon passes its pool (a memfd) with SCM_RIGHTS;
the client maps it once and reads or writes block slots in place. The socket carries small, batched
control frames.
"""

from __future__ import annotations

import mmap
import os
import socket
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tierkv.core import protocol
from tierkv.core.errors import BadRequest, ConnectionFailed, KeyMissing, TierKVError, error_from_code
from tierkv.core.keys import Namespace, chain_keys
from tierkv.core.layout import Layout, numpy_view_dtype
from tierkv.core.lookup_index import ClientIndex
from tierkv.core.lookup_index import available as lookup_index_available
from tierkv.core.paths import default_socket
from tierkv.core.protocol import Op

try:  # streaming-store copy (native/ntcopy.c): ~2x numpy for 2 MiB slots on machines like ours
    from tierkv._ntcopy import copy as _stream_copy
except ImportError:  # pragma: no cover - the extension is optional
    def _stream_copy(dst: Any, src: Any) -> None:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """uint8 numpy view of a contiguous CPU tensor's bytes (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


class Slots:
    """Slots allocated for new blocks (host, or GPU with ``tier="gpu"``): write ``views[i]`` in place,
    then :meth:`commit`.

    Slots that are never committed are given back by :meth:`abort`, on leaving a ``with`` block, or
    when the connection closes.
    """

    def __init__(self, client: Client, offsets: list[int], tier: str = "host") -> None:
        self._client = client
        self.offsets = offsets
        self.tier = tier
        self.views: list[torch.Tensor] = [client._view(off, tier) for off in offsets]
        self._open = True

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.views[i]

    def commit(self, keys: Sequence[bytes], durable: bool = False) -> int:
        """Publish the slots under ``keys``; returns how many were new. See :meth:`Client.commit`."""
        return self._client.commit(keys, self, durable=durable)

    def abort(self) -> None:
        """Give the slots back without publishing them."""
        if self._open and self.offsets:
            self._open = False
            self._client._call(Op.ABORT, {"slots": self.offsets, "tier": self.tier})
        self._open = False

    def __enter__(self) -> Slots:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._open:
            self.abort()


class Lease:
    """Blocks pinned in host (or GPU) memory for reading in place; release it (or leave the ``with``
    block). ``tiers[i]`` says where block ``i`` came from; ``tier`` which memory the views are in."""

    def __init__(self, client: Client, lease_id: int, offsets: list[int], tiers: list[str],
                 tier: str = "host") -> None:
        self._client = client
        self.id = lease_id
        self.offsets = offsets
        self.tiers = tiers
        self.tier = tier
        self.views: list[torch.Tensor] = [client._view(off, tier) for off in offsets]
        self._held = True

    @property
    def count(self) -> int:
        """How many leading blocks are available."""
        return len(self.offsets)

    def release(self) -> None:
        """End the lease; the views must not be used afterwards."""
        if self._held:
            self._held = False
            self.views = []
            self._client._call(Op.RELEASE, {"leases": [self.id]})

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# A durable put larger than DURABLE_FIRST_CHUNK_BYTES is sent in chunks, each chunk's copy overlapping
# the disk write of the ones before. The chunks grow from the first size to DURABLE_CHUNK_BYTES: a small
# first chunk reaches the disk writer after a short copy, which idles less between two durable puts.
DURABLE_FIRST_CHUNK_BYTES = 4 << 20
DURABLE_CHUNK_BYTES = 32 << 20


def _durable_chunks(n: int, block_bytes: int, host_bytes: int | None = None) -> list[tuple[int, int]]:
    """(lo, hi) ranges of a streamed durable put of ``n`` blocks: doubling from the first chunk size.

    With ``host_bytes`` (the host tier's capacity) a chunk is at most a quarter of it, so a put larger
    than the host tier streams through it while earlier chunks are still being written."""
    top = max(1, DURABLE_CHUNK_BYTES // block_bytes)
    if host_bytes is not None:
        top = min(top, max(1, host_bytes // 4 // _slot_bytes(block_bytes)))
    size = min(top, max(1, DURABLE_FIRST_CHUNK_BYTES // block_bytes))
    out, lo = [], 0
    while lo < n:
        out.append((lo, min(n, lo + size)))
        lo += size
        size = min(top, size * 2)
    first = out[0][1]
    if len(out) > 1 and out[-1][1] - out[-1][0] <= first:  # a tail no longer than the first chunk rides along
        out[-2:] = [(out[-2][0], n)]
    return out


def _slot_bytes(block_bytes: int) -> int:
    """Host slot bytes of a block: the daemon rounds slots up to 4 KiB pages."""
    return -(-block_bytes // 4096) * 4096


class Client:
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
        self._gpu = None
        if gpu is not None:
            from tierkv.tiers.gpu import ClientDevicePool

            self._gpu = ClientDevicePool(gpu, gpu_fd)
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
                tp_size: int = 1, timeout: float = 10.0, populate: bool = True, lookup_index: bool = True) -> Client:
        """Connect to the daemon and register the namespace.

        Args:
            socket: the daemon's socket path (default: ``$TIERKV_SOCKET`` or the daemon's default).
            model: model id; part of the namespace, so blocks are never shared across models.
            layout: the model's KV geometry.
            tp_rank: tensor-parallel rank of this engine process.
            tp_size: tensor-parallel world size.
            timeout: seconds to wait for the connection.
            populate: map every page of the pool at connect (no page faults later).
            lookup_index: answer :meth:`lookup` from the daemon's shared lookup index (False: always ask
                the daemon through the socket).

        Raises:
            ConnectionFailed: no daemon answers at that path.
            BadRequest: the namespace was refused.
        """
        import socket as _socket

        if not isinstance(layout, Layout):
            raise BadRequest("layout must be a tierkv.Layout")
        ns = Namespace(model, layout, tp_rank, tp_size)
        path = str(socket or default_socket())
        s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(path)
        except OSError as exc:
            s.close()
            raise ConnectionFailed(f"cannot reach tierkv at {path}: {exc.strerror or exc}") from None
        s.settimeout(None)
        try:
            s.sendall(protocol.pack(Op.HELLO, 1, {"namespace": ns.to_dict()}))
            op, status, _rid, body, fds = protocol.recv_frame_with_fds(s)
        except (OSError, ConnectionError) as exc:
            s.close()
            raise ConnectionFailed(f"tierkv at {path} closed the connection: {exc}") from None
        if status != protocol.STATUS_OK:
            for fd in fds:
                os.close(fd)
            s.close()
            raise error_from_code(body.get("code", ""), body.get("message", "hello refused"))
        gpu = body.get("gpu")
        index = body.get("lookup_index")
        standin = gpu is not None and gpu.get("kind") == "standin"
        if len(fds) != 1 + standin + (index is not None):
            for fd in fds:
                os.close(fd)
            s.close()
            raise ConnectionFailed("daemon did not pass its shared-memory pools")
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

    def __enter__(self) -> Client:
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

    # ---- keys -------------------------------------------------------------------------------------
    def block_keys(self, token_ids: Sequence[int] | np.ndarray | torch.Tensor,
                   parent: bytes | None = None) -> list[bytes]:
        """Chained keys of the full blocks of ``token_ids`` (a trailing partial block has no key)."""
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.detach().cpu().numpy()
        return chain_keys(self.fingerprint, token_ids, self.layout.block_tokens, parent)

    # ---- convenience layer ------------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], blocks: torch.Tensor | np.ndarray, durable: bool = False,
            tier: str | None = None) -> int:
        """Store blocks ``[n, 2, layers, kv_heads, block_tokens, head_dim]`` under ``keys``.

        Returns once committed (with ``durable=True``: once synced to the disk tier, which survives a
        ``kill -9`` of the daemon). Keys already cached are deduplicated (their data is not copied).
        ``tier="gpu"`` stores into GPU slots (a device-to-device copy; the daemon drains them to host
        memory and disk in the background); by default CUDA tensors go there when the daemon has a GPU.

        Returns:
            How many blocks were new.
        """
        keys = _check_keys(keys)
        tier = self._pick_tier(tier, blocks)
        if tier == "gpu":
            return self._put_gpu(keys, blocks, durable)
        src = self._check_blocks(blocks, len(keys))
        if not keys:
            return 0
        chunks = _durable_chunks(len(keys), self.layout.block_bytes, self._pool_bytes) if durable else []
        if len(chunks) <= 1:
            return self._put_host(keys, src, durable, True)
        # A large durable put streams: each chunk's disk write is queued at its commit, and the copy of
        # the next chunk overlaps it; one SYNC then waits for them all.
        new = 0
        try:
            for lo, hi in chunks:
                new += self._put_host(keys[lo:hi], src[lo:hi], True, False)
        except BaseException:
            try:
                self._call(Op.SYNC, {})  # leave no pending write behind for a later put to report
            except TierKVError:
                pass
            raise
        self._call(Op.SYNC, {})
        return new

    def _put_host(self, keys: list[bytes], src: Any, durable: bool, wait: bool) -> int:
        # A durable put writes every block, cached or not: a cached copy may live in host memory only,
        # and COMMIT makes durable exactly the keys it is given.
        offsets = self._call(Op.ALLOC, {"n": len(keys), "keys": None if durable else keys})["slots"]
        new_keys, new_slots = [], []
        try:
            for i, off in enumerate(offsets):
                if off is None:
                    continue
                _stream_copy(self._pool[off:off + self.layout.block_bytes].numpy(), _as_bytes(src[i]))
                new_keys.append(keys[i])
                new_slots.append(off)
        except BaseException:
            self._call(Op.ABORT, {"slots": [o for o in offsets if o is not None]})
            raise
        if not new_slots and not durable:
            return 0
        return int(self._call(Op.COMMIT, {"keys": new_keys, "slots": new_slots, "durable": durable,
                                          "wait": wait})["new"])

    def _put_gpu(self, keys: list[bytes], blocks: Any, durable: bool) -> int:
        assert self._gpu is not None
        src = self._check_blocks(blocks, len(keys), device=self._gpu.device)
        if not keys:
            return 0
        offsets = self._call(Op.ALLOC, {"n": len(keys), "keys": None if durable else keys, "tier": "gpu"})["slots"]
        new_keys, new_slots = [], []
        n = self.layout.block_bytes
        try:
            for i, off in enumerate(offsets):
                if off is None:
                    continue
                self._gpu.view(off, n).copy_(src[i].reshape(-1).view(torch.uint8))
                new_keys.append(keys[i])
                new_slots.append(off)
            if self._gpu.kind == "cuda":
                torch.cuda.current_stream(self._gpu.device).synchronize()  # the daemon reads on its own streams
        except BaseException:
            self._call(Op.ABORT, {"slots": [o for o in offsets if o is not None], "tier": "gpu"})
            raise
        if not new_slots and not durable:
            return 0
        return int(self._call(Op.COMMIT, {"keys": new_keys, "slots": new_slots, "durable": durable,
                                          "tier": "gpu"})["new"])

    def get(self, keys: Sequence[bytes], out: torch.Tensor | None = None, tier: str | None = None) -> torch.Tensor:
        """The blocks under ``keys`` as one tensor (promoting from disk as needed). ``tier="gpu"`` (the
        default when ``out`` is a CUDA tensor and the daemon has a GPU) reads through GPU slots into a
        tensor on the GPU tier's device.

        Raises:
            KeyMissing: a block is not cached (the message says which index is the first missing).
        """
        keys = _check_keys(keys)
        if self._pick_tier(tier, out) == "gpu":
            return self._get_gpu(keys, out)
        shape = self.layout.batch_shape(len(keys))
        if out is None:
            out = torch.empty(shape, dtype=self.layout.torch_dtype)
        elif tuple(out.shape) != shape or out.dtype != self.layout.torch_dtype or not out.is_contiguous():
            raise BadRequest(f"out must be a contiguous {self.layout.dtype} tensor of shape {shape}")
        if not keys:
            return out
        with self.acquire(keys) as lease:
            if lease.count < len(keys):
                raise KeyMissing(f"{len(keys) - lease.count} of {len(keys)} blocks are not cached "
                                 f"(first missing at index {lease.count})")
            n = self.layout.block_bytes
            for i, off in enumerate(lease.offsets):
                _stream_copy(_as_bytes(out[i]), self._pool[off:off + n].numpy())
        return out

    def _get_gpu(self, keys: list[bytes], out: torch.Tensor | None) -> torch.Tensor:
        assert self._gpu is not None
        shape = self.layout.batch_shape(len(keys))
        dev = torch.device(self._gpu.device)
        if out is None:
            out = torch.empty(shape, dtype=self.layout.torch_dtype, device=dev)
        elif (tuple(out.shape) != shape or out.dtype != self.layout.torch_dtype or not out.is_contiguous()
              or out.device != dev):
            raise BadRequest(f"out must be a contiguous {self.layout.dtype} tensor of shape {shape} on {dev}")
        if not keys:
            return out
        with self.acquire(keys, tier="gpu") as lease:
            if lease.count < len(keys):
                raise KeyMissing(f"{len(keys) - lease.count} of {len(keys)} blocks are not cached "
                                 f"(first missing at index {lease.count})")
            for i, v in enumerate(lease.views):
                out[i].copy_(v)
            if self._gpu.kind == "cuda":
                torch.cuda.current_stream(dev).synchronize()  # done reading before the lease ends
        return out

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading blocks of ``keys`` are cached in any tier.

        Answered from the daemon's shared lookup index when it can be (a few microseconds, no round
        trip); through the socket when the index is off or incomplete, or the prefix may continue in
        the remote tier."""
        keys = _check_keys(keys)
        if self._index is not None:
            n = self._index.prefix(self.fingerprint, keys)
            if n >= 0 and (n == len(keys) or not self._index.remote):
                self._check_alive()
                return n
        return int(self._call(Op.LOOKUP, {"keys": keys})["count"])

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

    def lookup_tiers(self, keys: Sequence[bytes]) -> list[str]:
        """The tier of each leading cached block ("host", "disk"); its length is :meth:`lookup`'s count."""
        return list(self._call(Op.LOOKUP, {"keys": _check_keys(keys), "tiers": True})["tiers"])

    # ---- zero-copy layer --------------------------------------------------------------------------
    def alloc(self, n: int, tier: str = "host") -> Slots:
        """Allocate ``n`` slots to write new blocks into, in place (``slots.views[i]``); ``tier="gpu"``
        gives device views in the GPU tier (finish writing, e.g. synchronise the stream, before commit)."""
        if not isinstance(n, int) or n < 0:
            raise BadRequest("n must be a non-negative int")
        tier = self._pick_tier(tier, None)
        return Slots(self, self._call(Op.ALLOC, {"n": n, "tier": tier})["slots"], tier)

    def commit(self, keys: Sequence[bytes], slots: Slots, durable: bool = False) -> int:
        """Publish written slots under ``keys`` (immutable from now on); duplicates are deduplicated.

        Returns:
            How many blocks were new.
        """
        keys = _check_keys(keys)
        if not isinstance(slots, Slots) or not slots._open:
            raise BadRequest("slots must be an uncommitted Slots from alloc()")
        if len(keys) != len(slots):
            raise BadRequest(f"{len(keys)} keys for {len(slots)} slots")
        slots._open = False
        return int(self._call(Op.COMMIT, {"keys": keys, "slots": slots.offsets, "durable": durable,
                                          "tier": slots.tier})["new"])

    def acquire(self, keys: Sequence[bytes], tier: str = "host") -> Lease:
        """Lease the longest cached prefix of ``keys`` in host memory (or GPU memory with ``tier="gpu"``),
        promoting from colder tiers; read ``lease.views`` in place, then release. ``lease.count`` may be
        less than ``len(keys)``."""
        tier = self._pick_tier(tier, None)
        r = self._call(Op.ACQUIRE, {"keys": _check_keys(keys), "tier": tier})
        return Lease(self, int(r["lease"]), list(r["slots"]), list(r["tiers"]), tier)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Drop blocks from every tier (an invalidation); leased blocks are kept. Returns blocks dropped."""
        return int(self._call(Op.DELETE, {"keys": _check_keys(keys)})["deleted"])

    def fetch(self, keys: Sequence[bytes], tier: str = "host") -> int:
        """Start bringing the cached prefix of ``keys`` into host memory (or GPU memory with
        ``tier="gpu"``); returns a ticket for :meth:`wait`. Never blocks on the disk."""
        tier = self._pick_tier(tier, None)
        ticket = int(self._call(Op.FETCH, {"keys": _check_keys(keys), "tier": tier})["ticket"])
        self._tickets[ticket] = tier
        return ticket

    def wait(self, ticket: int, timeout: float | None = None) -> Lease:
        """A lease on the exact prefix that arrived within ``timeout`` seconds (``None``: all of it).
        A short prefix is a normal result, never an error; the rest keeps loading in the background."""
        r = self._call(Op.WAIT, {"ticket": ticket, "timeout": timeout})
        return Lease(self, int(r["lease"]), list(r["slots"]), list(r["tiers"]), self._tickets.pop(ticket, "host"))

    def prefetch(self, keys: Sequence[bytes], tier: str = "host") -> int:
        """Announce a queued request: its disk blocks are promoted to host memory (with ``tier="gpu"``,
        every block not on the GPU yet to GPU memory) in the background. Returns at once with how many
        loads started."""
        tier = self._pick_tier(tier, None)
        return int(self._call(Op.PREFETCH, {"keys": _check_keys(keys), "tier": tier})["started"])

    def request_finished(self, keys: Sequence[bytes]) -> int:
        """Tell the daemon a request finished: ``keys`` (its chained block keys, prompt and output, in
        order) are a conversation tail the next turn may extend, so the daemon keeps them (writes them
        to disk when they leave host memory). Returns how many of the keys are cached."""
        return int(self._call(Op.REQUEST_FINISHED, {"keys": _check_keys(keys)})["cached"])

    def lookup_plan(self, keys: Sequence[bytes]) -> dict[str, Any]:
        """Per leading cached block: ``tiers``, ``ready`` (in host memory now), and ``fetch``: how many
        leading blocks are worth fetching rather than recomputing, from the daemon's measured tier
        speeds and the recompute speed reported with :meth:`report_recompute`."""
        return self._call(Op.PLAN, {"keys": _check_keys(keys)})

    def report_recompute(self, tokens: int, seconds: float) -> float:
        """Tell the cost model how fast this engine prefills (``tokens`` in ``seconds``)."""
        return float(self._call(Op.RECOMPUTE, {"tokens": int(tokens), "seconds": float(seconds)})["tokens_per_s"])

    def get_prefix(self, keys: Sequence[bytes], timeout: float | None = None) -> torch.Tensor:
        """The leading blocks worth loading, as one tensor ``[m, 2, L, H, T, D]`` (``m`` may be 0).

        Follows the cost model: a cold run that would load slower than recomputing it ends the prefix,
        so a hit is never slower than recomputation. ``timeout`` bounds the wait for disk loads.
        """
        keys = _check_keys(keys)
        n = self.lookup_plan(keys)["fetch"] if keys else 0
        if n == 0:
            return torch.empty(self.layout.batch_shape(0), dtype=self.layout.torch_dtype)
        with self.wait(self.fetch(keys[:n]), timeout) as lease:
            out = torch.empty(self.layout.batch_shape(lease.count), dtype=self.layout.torch_dtype)
            nb = self.layout.block_bytes
            for i, off in enumerate(lease.offsets):
                _stream_copy(_as_bytes(out[i]), self._pool[off:off + nb].numpy())
        return out

    # ---- paged engine caches ----------------------------------------------------------------------
    def store_paged(self, keys: Sequence[bytes], k_caches: Any, v_caches: Any, block_ids: Any,
                    *, layout: str = "NHD", durable: bool = False, tier: str | None = None) -> int:
        """Offload straight from an engine's paged KV cache (vLLM-style per-layer K and V of shape
        ``[num_blocks, block_tokens, kv_heads, head_dim]``, or ``"HND"``): the engine blocks
        ``block_ids`` are gathered into fresh slots in one pass and committed under ``keys``. Caches on
        a CUDA device go into GPU-tier slots (one device-to-device kernel) when the daemon has a GPU tier.

        Returns:
            How many blocks were new.
        """
        from tierkv.client.paged import gather

        keys = _check_keys(keys)
        if len(block_ids) != len(keys):
            raise BadRequest("one engine block id per key")
        tier = self._pick_tier(tier, _first_tensor(k_caches))
        with self.alloc(len(keys), tier=tier) as slots:
            gather(k_caches, v_caches, block_ids, slots.views, layout=layout)
            self._sync_device(tier)
            return slots.commit(keys, durable=durable)

    def load_paged(self, keys: Sequence[bytes], k_caches: Any, v_caches: Any, block_ids: Any,
                   *, layout: str = "NHD", tier: str | None = None) -> int:
        """Load the cached prefix of ``keys`` straight into an engine's paged KV cache at ``block_ids``
        (one scatter pass); returns how many leading blocks were loaded."""
        from tierkv.client.paged import scatter

        keys = _check_keys(keys)
        if len(block_ids) != len(keys):
            raise BadRequest("one engine block id per key")
        tier = self._pick_tier(tier, _first_tensor(k_caches))
        with self.acquire(keys, tier=tier) as lease:
            if lease.count:
                scatter(lease.views, k_caches, v_caches, list(block_ids)[:lease.count], layout=layout)
                self._sync_device(tier)  # the copy must be done before the lease ends
            return lease.count

    def _sync_device(self, tier: str) -> None:
        if tier == "gpu" and self._gpu is not None and self._gpu.kind == "cuda":
            torch.cuda.current_stream(self._gpu.device).synchronize()

    def release(self, lease: Lease) -> None:
        """End a lease (same as ``lease.release()``)."""
        lease.release()

    # ---- hints and introspection ------------------------------------------------------------------
    def touch(self, keys: Sequence[bytes], scores: Sequence[float]) -> int:
        """Report attention mass per block (1.0 = uniform) for placement; returns blocks found."""
        keys = _check_keys(keys)
        scores = [float(x) for x in scores]
        if len(scores) != len(keys):
            raise BadRequest("scores must be as long as keys")
        return int(self._call(Op.TOUCH, {"keys": keys, "scores": scores})["touched"])

    def pin_prefix(self, keys: Sequence[bytes], priority: int = 80) -> int:
        """Keep a frozen prefix (system prompt, tool descriptions) in the host tier until :meth:`unpin`.

        Args:
            keys: the prefix's block keys (blocks must already be stored; missing ones end the prefix).
            priority: retention priority 1..100, as in TensorRT-LLM's retention config.

        Returns:
            How many leading blocks are now pinned.
        """
        return int(self._call(Op.PIN, {"keys": _check_keys(keys), "priority": priority})["pinned"])

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Make pinned blocks evictable again; returns how many were pinned."""
        return int(self._call(Op.UNPIN, {"keys": _check_keys(keys)})["unpinned"])

    def set_window(self, keys: Sequence[bytes], budget: int, sinks: int = 1, recent: int = 8) -> int:
        """Fit a live sequence longer than its fast-tier budget: keep the first ``sinks`` blocks
        (attention sinks), the last ``recent`` blocks, and the middle blocks with the most attention
        mass (see :meth:`touch`) up to ``budget`` blocks in host memory; the rest are demoted to disk,
        never dropped. Returns how many blocks were demoted."""
        return int(self._call(Op.WINDOW, {"keys": _check_keys(keys), "budget": budget, "sinks": sinks,
                                          "recent": recent})["demoted"])

    def stats(self) -> dict[str, Any]:
        """The daemon's figures: per tier capacity, usage, hits, misses, bytes, evictions, ..."""
        return self._call(Op.STATS, {})

    def health(self) -> dict[str, Any]:
        """``{"status": "ok" | "degraded", "reason": ...}``."""
        return self._call(Op.HEALTH, {})

    def ping(self) -> dict[str, Any]:
        """Round trip to the daemon."""
        return self._call(Op.PING, {})

    # ---- validation -------------------------------------------------------------------------------
    def _check_blocks(self, blocks: torch.Tensor | np.ndarray, n: int, device: str = "cpu") -> torch.Tensor:
        shape = self.layout.batch_shape(n)
        if isinstance(blocks, np.ndarray):
            want = numpy_view_dtype(self.layout.dtype)
            if blocks.dtype != want:
                raise BadRequest(f"blocks dtype {blocks.dtype} does not match the layout ({self.layout.dtype}"
                                 f"{', as raw uint16 in numpy' if self.layout.dtype == 'bfloat16' else ''})")
            t = torch.from_numpy(np.ascontiguousarray(blocks))
            if self.layout.dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
                t = t.view(self.layout.torch_dtype)
        elif isinstance(blocks, torch.Tensor):
            t = blocks
            if t.dtype != self.layout.torch_dtype:
                raise BadRequest(f"blocks dtype {t.dtype} does not match the layout ({self.layout.dtype})")
        else:
            raise BadRequest("blocks must be a torch tensor or numpy array")
        if tuple(t.shape) != shape:
            raise BadRequest(f"blocks have shape {tuple(t.shape)}; expected {shape} "
                             "[n, 2, layers, kv_heads, block_tokens, head_dim]")
        if t.device != torch.device(device):
            t = t.to(device)
        return t.contiguous()


def _first_tensor(caches: Any) -> Any:
    """The first tensor of a per-layer list (or the tensor itself): it tells where the caches live."""
    if isinstance(caches, list | tuple) and caches:
        return caches[0]
    return caches


def _check_keys(keys: Sequence[bytes]) -> list[bytes]:
    if isinstance(keys, bytes | str):
        raise BadRequest("keys must be a sequence of bytes keys, not a single key")
    out = list(keys)
    for k in out:
        if not isinstance(k, bytes) or not (1 <= len(k) <= 128):
            raise BadRequest("each key must be 1..128 bytes")
    if len(set(out)) != len(out):
        raise BadRequest("keys contain duplicates")
    return out

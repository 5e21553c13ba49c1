"""The client of one model namespace: put/get, lookups, slots and leases, paged-cache copies, hints.

The convenience layer (put/get) copies between the caller's tensors and pool slots; the zero-copy
layer (alloc/commit, acquire/release) hands out the slots themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tierkv.client.checks import (
    check_blocks,
    check_chains,
    check_flag,
    check_keys,
    check_out,
    check_parent,
    check_seconds,
    check_tokens,
    first_tensor,
)
from tierkv.client.copies import as_bytes, copy_pairs, new_batch
from tierkv.client.durable import durable_chunks, slot_bytes
from tierkv.client.hints import Hints
from tierkv.client.slots import Lease, Slots
from tierkv.core.errors import BadRequest, KeyMissing, TierKVError
from tierkv.core.keys import chain_keys
from tierkv.core.protocol import Op

if TYPE_CHECKING:
    from tierkv.client.paged import EngineLayout

__all__ = ["Client", "Lease", "Slots"]


class Client(Hints):
    """The client of one model namespace: connect with :meth:`Client.connect`. Thread-safe. The engine's
    hints and the daemon's figures are :class:`~tierkv.client.hints.Hints`."""

    # ---- keys -------------------------------------------------------------------------------------
    def block_keys(self, token_ids: Sequence[int] | np.ndarray | torch.Tensor,
                   parent: bytes | None = None) -> list[bytes]:
        """Chained keys of the full blocks of ``token_ids`` (a trailing partial block has no key)."""
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.detach().cpu().numpy()
        return chain_keys(self.fingerprint, token_ids, self.layout.block_tokens, parent)

    # ---- convenience layer ------------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], blocks: torch.Tensor | np.ndarray, durable: bool = False,
            tier: str | None = None, timeout: float | None = None, parent: bytes | None = None,
            remote: bool = False, tokens: Sequence[int] | np.ndarray | None = None, tenant: str | None = None) -> int:
        """Store blocks ``[n, 2, layers, kv_heads, block_tokens, head_dim]`` under ``keys`` (for ``tenant``,
        whose quotas count them, when given).

        Returns once committed (with ``durable=True``: once synced to the disk tier, which survives a
        ``kill -9`` of the daemon; with ``remote=True``: once written through to the remote tier, see
        :meth:`commit`). Keys already cached are deduplicated (not copied unless durable or remote).
        ``tier="gpu"`` stores into GPU slots (a device-to-device copy; the daemon drains them to host memory
        and disk in the background); by default CUDA tensors go there when the daemon has a GPU. A durable
        host put larger than a chunk (or than a quarter of the host tier) streams through the host tier to
        disk in chunks.

        A full host tier makes room from clean blocks first. ``timeout`` bounds the wait for the disk writer
        to clean more (None: the daemon's ``server.slot_wait_s``); past it, or at once with ``timeout=0``,
        blocks not yet written to disk are dropped to make room (later misses, never a stalled caller).

        ``keys`` are one prefix chain, each the child of the one before; ``parent`` is the key the chain
        continues (the last block of a cached prefix; None: ``keys[0]`` starts a chain). The daemon's
        eviction order keeps chains whole from the head and takes them from the tail. ``tokens``: the
        blocks' token ids (``len(keys) * block_tokens``) for the daemon's KV events.

        Returns:
            How many blocks were new.

        Raises:
            BadRequest: bad keys or blocks, or a put that is not durable and exceeds the host tier.
        """
        keys = check_keys(keys)
        parent = check_parent(parent, keys)
        remote = check_flag(remote, "remote")
        tier = self._pick_tier(tier, blocks)
        src = check_blocks(self.layout, blocks, len(keys), self._device(tier))
        wire = check_tokens(tokens, len(keys), self.layout.block_tokens)
        if not keys:
            return 0
        chunks = durable_chunks(len(keys), self.layout.block_bytes, self._pool_bytes) if durable else []
        if tier == "gpu" or len(chunks) <= 1:
            return self._store(keys, src, durable, tier, timeout=timeout, parent=parent, remote=remote, tokens=wire,
                               tenant=tenant)
        # A large durable put streams: each chunk's disk write is queued at its commit, and the copy of
        # the next chunk overlaps it; one SYNC then waits for them all.
        new, tb = 0, self.layout.block_tokens * 4
        try:
            for lo, hi in chunks:
                new += self._store(keys[lo:hi], src[lo:hi], True, tier, wait=False, timeout=timeout,
                                   parent=keys[lo - 1] if lo else parent, remote=remote, tenant=tenant,
                                   tokens=wire[lo * tb:hi * tb] if wire is not None else None)
        except BaseException:
            try:
                self._call(Op.SYNC, {})  # leave no pending write behind for a later put to report
            except TierKVError:
                pass
            raise
        self._call(Op.SYNC, {})
        return new

    def _store(self, keys: list[bytes], src: torch.Tensor, durable: bool, tier: str, wait: bool = True,
               timeout: float | None = None, parent: bytes | None = None, remote: bool = False,
               tokens: bytes | None = None, tenant: str | None = None) -> int:
        """ALLOC, copy the blocks not cached yet into their slots, COMMIT (ABORT if the copy fails)."""
        # A durable or remote put sends every block, cached or not (a cached one may be in host memory only)
        body: dict[str, Any] = {"n": len(keys), "keys": None if durable or remote else keys, "tier": tier}
        if timeout is not None:
            body["timeout"] = check_seconds(timeout)
        offsets = self._call(Op.ALLOC, body)["slots"]
        todo = [i for i, off in enumerate(offsets) if off is not None]
        slots = [offsets[i] for i in todo]
        try:
            self._write(tier, slots, src, todo)
        except BaseException:
            self._call(Op.ABORT, {"slots": slots, "tier": tier})
            raise
        if not slots and not (durable or remote):
            return 0
        body = {"keys": [keys[i] for i in todo], "slots": slots, "durable": durable, "tier": tier, "wait": wait,
                "remote": remote}
        # each run of blocks not cached continues the block before it (the caller's parent for the first)
        chains = [[j, keys[i - 1] if i else parent] for j, i in enumerate(todo) if j == 0 or i != todo[j - 1] + 1]
        if chains and chains != [[0, None]]:
            body["chains"] = chains
        if tenant is not None and slots:
            body["tenants"] = [[0, tenant]]
        if tokens is not None:
            tb = self.layout.block_tokens * 4
            body["tokens"] = b"".join(tokens[i * tb:(i + 1) * tb] for i in todo)
        return int(self._call(Op.COMMIT, body)["new"])

    def _write(self, tier: str, slots: list[int], src: torch.Tensor, rows: list[int]) -> None:
        """Copy blocks ``src[rows[j]]`` into ``slots[j]``; done before the daemon may read them."""
        nb = self.layout.block_bytes
        if tier == "gpu":
            assert self._gpu is not None
            for off, i in zip(slots, rows):
                self._gpu.view(off, nb).copy_(src[i].reshape(-1).view(torch.uint8))
            self._gpu.synchronize()  # the daemon reads on its own streams
            return
        pool, flat = self._pool.numpy(), as_bytes(src)
        copy_pairs([(pool[off:off + nb], flat[i * nb:(i + 1) * nb]) for off, i in zip(slots, rows)])

    def _read(self, tier: str, offsets: list[int], out: torch.Tensor) -> None:
        """Copy the blocks in ``offsets`` into ``out[0:len(offsets)]``; done before the lease ends."""
        nb = self.layout.block_bytes
        if tier == "gpu":
            assert self._gpu is not None
            for i, off in enumerate(offsets):
                out[i].reshape(-1).view(torch.uint8).copy_(self._gpu.view(off, nb))
            self._gpu.synchronize()
            return
        pool, flat = self._pool.numpy(), as_bytes(out)
        copy_pairs([(flat[i * nb:(i + 1) * nb], pool[off:off + nb]) for i, off in enumerate(offsets)])

    def get(self, keys: Sequence[bytes], out: torch.Tensor | None = None, tier: str | None = None) -> torch.Tensor:
        """The blocks under ``keys`` as one tensor (promoting from disk as needed; more than a quarter of the
        host tier is read through it in chunks). ``tier="gpu"`` (the
        default when ``out`` is a CUDA tensor and the daemon has a GPU) reads through GPU slots into a
        tensor on the GPU tier's device.

        Raises:
            KeyMissing: a block is not cached (the message says which index is the first missing).
            BadRequest: bad keys, or ``out`` does not fit the blocks.
        """
        keys = check_keys(keys)
        tier = self._pick_tier(tier, out)
        if out is None:
            out = (new_batch(self.layout, len(keys)) if tier == "host" else
                   torch.empty(self.layout.batch_shape(len(keys)), dtype=self.layout.torch_dtype,
                               device=self._device(tier)))
        else:
            check_out(self.layout, out, len(keys), self._device(tier))
        if not keys:
            return out
        # more blocks than a quarter of the host tier are read in chunks: blocks on disk stream through
        step = len(keys) if tier != "host" else max(1, self._pool_bytes // 4 // slot_bytes(self.layout.block_bytes))
        for lo in range(0, len(keys), step):
            part = keys[lo:lo + step]
            with self.acquire(part, tier=tier) as lease:
                if lease.count < len(part):
                    raise KeyMissing(f"block {lo + lease.count} of {len(keys)} is not cached (first missing at "
                                     f"index {lo + lease.count})")
                self._read(tier, lease.offsets, out[lo:lo + len(part)])
        return out

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading blocks of ``keys`` are cached in any tier.

        Answered from the daemon's shared lookup index when it can be (a few microseconds, no round
        trip); through the socket when the index is off or incomplete, or the prefix may continue in
        the remote tier."""
        keys = check_keys(keys)
        if self._index is not None:
            n = self._index.prefix(self.fingerprint, keys)
            if n >= 0 and (n == len(keys) or not self._index.remote):
                self._check_alive()
                return n
        return int(self._call(Op.LOOKUP, {"keys": keys})["count"])

    def cached(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Per key, whether a local tier of the daemon holds it, answered from the shared lookup index
        (no round trip). None when the index cannot answer: it is off or incomplete, or kept changing
        during the read. A key may leave or arrive right after: the answer is a hint, and a commit stays
        correct either way (a cached key is deduplicated; a key gone since is a later miss)."""
        keys = check_keys(keys)
        out = self._index.held(self.fingerprint, keys) if self._index is not None else None
        if out is not None:
            self._check_alive()
        return out

    def lookup_tiers(self, keys: Sequence[bytes]) -> list[str]:
        """The tier of each leading cached block ("host", "disk"); its length is :meth:`lookup`'s count."""
        return list(self._call(Op.LOOKUP, {"keys": check_keys(keys), "tiers": True})["tiers"])

    # ---- zero-copy layer --------------------------------------------------------------------------
    def alloc(self, n: int, tier: str = "host", timeout: float | None = None,
              keep: Sequence[bytes] = ()) -> Slots:
        """Allocate ``n`` slots to write new blocks into, in place (``slots.views[i]``); ``tier="gpu"``
        gives device views in the GPU tier (finish writing, e.g. synchronise the stream, before commit).

        A full host tier makes room at once (clean blocks first, then blocks not yet written to disk);
        only while every block is in use does it wait, at most ``timeout`` seconds (None: the daemon's
        ``server.slot_wait_s``), then raise :class:`~tierkv.core.errors.TierFull`. ``keep``: cached
        blocks the new ones continue (a store that skips them, see :meth:`commit`'s ``uses``), which
        this allocation does not evict to make room."""
        if not isinstance(n, int) or n < 0:
            raise BadRequest("n must be a non-negative int")
        tier = self._pick_tier(tier, None)
        body: dict[str, Any] = {"n": n, "tier": tier}
        if timeout is not None:
            body["timeout"] = check_seconds(timeout)
        if keep:
            body["keep"] = check_keys(keep)
        return Slots(self, self._call(Op.ALLOC, body)["slots"], tier)

    def commit(self, keys: Sequence[bytes], slots: Slots, durable: bool = False,
               chains: Sequence[tuple[int, bytes | None]] | None = None, remote: bool = False,
               tokens: Sequence[int] | np.ndarray | None = None, uses: Sequence[bytes] = (),
               tenants: Sequence[tuple[int, str | None]] | None = None) -> int:
        """Publish written slots under ``keys`` (immutable from now on); duplicates are deduplicated.
        ``tenants``: ``(index, tenant)`` where the keys of one tenant start (its quotas count them).

        ``keys`` are prefix chains, each key the child of the one before, except where ``chains`` says a
        chain starts: pairs ``(index into keys, the key that chain continues or None)``. None: one
        chain from ``keys[0]`` (see :meth:`put`'s ``parent``). ``tokens``: the blocks' token ids
        (``len(keys) * block_tokens``), which a daemon publishing KV events sends to routers.
        ``uses``: cached blocks the caller skipped rather than write again (see :meth:`cached`); each
        counts as a use, before the new blocks are published, as a deduplicated block does (one gone
        since is ignored).

        ``remote=True`` writes every block through to the remote tier whatever ``remote.admission`` says
        and returns once written, for daemons on other nodes sharing it; at once when there is no remote
        tier or it is down. A failed remote write is logged and counted (``put_dropped``), not raised.

        Returns:
            How many blocks were new.
        """
        keys = check_keys(keys)
        starts = check_chains(chains, keys)
        remote = check_flag(remote, "remote")
        if not isinstance(slots, Slots) or not slots._open:
            raise BadRequest("slots must be an uncommitted Slots from alloc()")
        if len(keys) != len(slots):
            raise BadRequest(f"{len(keys)} keys for {len(slots)} slots")
        wire_tokens = check_tokens(tokens, len(keys), self.layout.block_tokens)
        used = check_keys(uses)
        slots._open = False
        body = {"keys": keys, "slots": slots.offsets, "durable": durable, "tier": slots.tier, "remote": remote}
        if starts:
            body["chains"] = starts
        if used:
            body["uses"] = used
        if tenants:
            body["tenants"] = [[int(i), t] for i, t in tenants]
        if wire_tokens is not None:
            body["tokens"] = wire_tokens
        return int(self._call(Op.COMMIT, body)["new"])

    def acquire(self, keys: Sequence[bytes], tier: str = "host") -> Lease:
        """Lease the longest cached prefix of ``keys`` in host memory (or GPU memory with ``tier="gpu"``),
        promoting from colder tiers; read ``lease.views`` in place, then release. ``lease.count`` may be
        less than ``len(keys)``."""
        tier = self._pick_tier(tier, None)
        r = self._call(Op.ACQUIRE, {"keys": check_keys(keys), "tier": tier})
        return Lease(self, int(r["lease"]), list(r["slots"]), list(r["tiers"]), tier)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Drop blocks from every tier (an invalidation); leased blocks are kept. Returns blocks dropped."""
        return int(self._call(Op.DELETE, {"keys": check_keys(keys)})["deleted"])

    def fetch(self, keys: Sequence[bytes], tier: str = "host") -> int:
        """Start bringing the cached prefix of ``keys`` into host memory (or GPU memory with
        ``tier="gpu"``); returns a ticket for :meth:`wait`. Never blocks on the disk."""
        tier = self._pick_tier(tier, None)
        ticket = int(self._call(Op.FETCH, {"keys": check_keys(keys), "tier": tier})["ticket"])
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
        return int(self._call(Op.PREFETCH, {"keys": check_keys(keys), "tier": tier})["started"])

    def get_prefix(self, keys: Sequence[bytes], timeout: float | None = None) -> torch.Tensor:
        """The leading blocks worth loading, as one tensor ``[m, 2, L, H, T, D]`` (``m`` may be 0).

        Follows the cost model: a cold run that would load slower than recomputing it ends the prefix,
        so a hit is never slower than recomputation. ``timeout`` bounds the wait for disk loads.
        """
        keys = check_keys(keys)
        n = self.lookup_plan(keys)["fetch"] if keys else 0
        if n == 0:
            return torch.empty(self.layout.batch_shape(0), dtype=self.layout.torch_dtype)
        with self.wait(self.fetch(keys[:n]), timeout) as lease:
            out = new_batch(self.layout, lease.count)
            self._read("host", lease.offsets, out)
        return out

    # ---- paged engine caches ----------------------------------------------------------------------
    def store_paged(self, keys: Sequence[bytes], k_caches: Any, v_caches: Any, block_ids: Any,
                    *, layout: EngineLayout = "NHD", durable: bool = False, tier: str | None = None) -> int:
        """Offload straight from an engine's paged KV cache (vLLM-style per-layer K and V of shape
        ``[num_blocks, block_tokens, kv_heads, head_dim]``, or ``"HND"``): the engine blocks
        ``block_ids`` are gathered into fresh slots in one pass and committed under ``keys``. Caches on
        a CUDA device go into GPU-tier slots (one device-to-device kernel) when the daemon has a GPU tier.

        Returns:
            How many blocks were new.
        """
        from tierkv.client.paged import gather

        keys = check_keys(keys)
        if len(block_ids) != len(keys):
            raise BadRequest("one engine block id per key")
        tier = self._pick_tier(tier, first_tensor(k_caches))
        with self.alloc(len(keys), tier=tier) as slots:
            gather(k_caches, v_caches, block_ids, slots.views, layout=layout)
            self._sync_device(tier)
            return slots.commit(keys, durable=durable)

    def load_paged(self, keys: Sequence[bytes], k_caches: Any, v_caches: Any, block_ids: Any,
                   *, layout: EngineLayout = "NHD", tier: str | None = None) -> int:
        """Load the cached prefix of ``keys`` straight into an engine's paged KV cache at ``block_ids``
        (one scatter pass); returns how many leading blocks were loaded."""
        from tierkv.client.paged import scatter

        keys = check_keys(keys)
        if len(block_ids) != len(keys):
            raise BadRequest("one engine block id per key")
        tier = self._pick_tier(tier, first_tensor(k_caches))
        with self.acquire(keys, tier=tier) as lease:
            if lease.count:
                scatter(lease.views, k_caches, v_caches, list(block_ids)[:lease.count], layout=layout)
                self._sync_device(tier)  # the copy must be done before the lease ends
            return lease.count

    def _sync_device(self, tier: str) -> None:
        if tier == "gpu" and self._gpu is not None:
            self._gpu.synchronize()

    def release(self, lease: Lease) -> None:
        """End a lease (same as ``lease.release()``)."""
        lease.release()

"""The block store: the daemon's tiers, the block table and placement decisions over them, the cost model,
the transfer engine that moves bytes between them, and the evictor thread.

Every request handler calls one public method here. All state changes happen under one lock (with a
condition for waiters); waits on transfers happen outside it. The paths live in their own modules:
:mod:`~tierkv.daemon.storepath` (alloc, commit), :mod:`~tierkv.daemon.fetchpath` (lookup, fetch, wait),
:mod:`~tierkv.daemon.gpupath` (drains, promotions), :mod:`~tierkv.daemon.tier_jobs` (disk and remote
jobs, verify), :mod:`~tierkv.daemon.evictor`, :mod:`~tierkv.daemon.scrub` and :mod:`~tierkv.daemon.tuning`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tierkv.cache.block import Session
from tierkv.cache.costmodel import CostModel
from tierkv.cache.counters import TierCounters
from tierkv.cache.placement import DiskPlacement, GpuPlacement, HostPlacement
from tierkv.cache.policy import make_policy as _lru
from tierkv.cache.reuse import History, ReuseModel
from tierkv.cache.table import BlockTable
from tierkv.cache.wiring import host_reuse
from tierkv.core.errors import BadRequest, TierFull
from tierkv.core.keys import Namespace, chain_keys
from tierkv.core.prefix import tier_tokens
from tierkv.daemon import learned, retention, scrub, snapshot, tuning
from tierkv.daemon.config import Config
from tierkv.daemon.events import open_events
from tierkv.daemon.evictor import Evictor
from tierkv.daemon.fetchpath import FetchPath
from tierkv.daemon.gpupath import GpuPath, check_gpu
from tierkv.daemon.startup import make_admission, make_disk_policy, make_host_policy, open_tiers
from tierkv.daemon.storepath import StorePath
from tierkv.daemon.tier_jobs import TierJobs
from tierkv.movers.transfer import TransferEngine
from tierkv.tiers.disk import stored_size
from tierkv.tiers.host import slot_size_for

if TYPE_CHECKING:
    from tierkv.tiers.gpu import DevicePool

HISTORY_ENTRIES = 1 << 16


class BlockStore:
    """All blocks of one daemon, in every tier it runs."""

    def __init__(self, cfg: Config, data_dir: str) -> None:
        """Open the tiers, rebuild the records of what is on disk and start the evictor."""
        self.cfg = cfg
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.table = BlockTable(cfg.server.lookup_index_slots)
        self.tiers = open_tiers(cfg, data_dir)
        self.host, self.disk, self.remote = self.tiers.host, self.tiers.disk, self.tiers.remote
        self.gpu: DevicePool | None = None  # set by _attach_gpu
        # One use history for both tiers (heat survives demotion), bounded so that a stream of
        # one-shot keys cannot grow the daemon's memory (~150 B a record).
        self.history = History(max_entries=HISTORY_ENTRIES)
        # Which host blocks come back once they leave host memory (the host policy's reuse term). The
        # host policy scores a block while its request runs, before the generated-token count is
        # known, so that count is not one of its classes.
        self.host_reuse = host_reuse(HISTORY_ENTRIES)
        # Which host victims reach disk: learned from requests, stores and the engine's signals. Its own
        # history: the policies count uses with decay, admission counts each request once.
        self.admission = make_admission(cfg, self.history, HISTORY_ENTRIES)
        self.data_dir = data_dir
        learned.load(self.learned_models(), data_dir)
        self.diskp = DiskPlacement(self.table, make_disk_policy(cfg, self.history, self.admission.evict_model), cfg,
                                   lambda: self.disk.capacity if self.disk is not None else 0, stored_size)
        self.cost = CostModel()  # fetch or recompute: fed the rates the loads measure
        self.engine = TransferEngine(self.disk, cfg.disk.workers, cfg.disk.codec, cfg.disk.codec_level,
                                     write_batch=cfg.disk.write_batch,
                                     budgets={"host<->disk": cfg.budget.host_disk or None,
                                              "gpu<->host": cfg.budget.gpu_host or None,
                                              "host<->remote": cfg.budget.host_remote or None},
                                     write_nice=cfg.disk.write_nice)
        if self.remote is not None:
            self.engine.attach_remote(self.remote)
        self.hostp = HostPlacement(self.table, self.host, make_host_policy(cfg, self.history, self.host_reuse),
                                   self.diskp, self.disk is not None, self.host_reuse, self.admission, cfg,
                                   lambda: self.engine.store_backlog() == 0)
        self.remote_stats = TierCounters()
        self.remote_info: tuple[float, dict | None] = (0.0, None)  # (when, remote server memory)
        self.degraded = ""
        self.closing = False
        self._host_t: Any = None  # torch view of the whole host pool (GPU copies)
        self.gpup: GpuPlacement | None = None
        self.gpu_path: GpuPath | None = None
        if self.tiers.gpu is not None:
            self._attach_gpu(self.tiers.gpu)
        self.transfers = TierJobs(self)
        self.store_path = StorePath(self)
        self.fetch_path = FetchPath(self)
        self.evictor = Evictor(self)
        self.events = open_events(cfg.events, self.table, self.lock, data_dir if self.disk is not None else None)
        if self.disk is not None:
            scrub.scan_disk(self)
        if self.events is not None:
            self.events.start()
        self.evictor.start()

    def _attach_gpu(self, gpu: DevicePool) -> None:
        try:
            self.engine.attach_device(gpu, self.host)
        except Exception:
            gpu.close()
            raise
        self.gpu = gpu
        # device slots are few and clean once drained: plain recency
        self.gpup = GpuPlacement(self.table, gpu, _lru("lru"), self.diskp)
        self.gpu_path = GpuPath(self)

    # ---- shared by the paths (lock held) ----------------------------------------------------------
    def ns(self, s: Session) -> Namespace:
        """The connection's namespace; BadRequest before HELLO."""
        if s.ns is None:
            raise BadRequest("no namespace on this connection: send HELLO first")
        return s.ns

    def tier(self, tier: object) -> str:
        """Check a tier name from the wire: "host", or "gpu" when the GPU tier is on."""
        if tier == "host":
            return "host"
        if tier == "gpu":
            check_gpu(self)
            return "gpu"
        raise BadRequest(f"tier must be 'host' or 'gpu', got {tier!r}")

    def host_slot(self, slot: int, wait: bool = True, timeout: float | None = None, drop_dirty: bool = True) -> int:
        """A host slot, evicting clean blocks first. With ``timeout`` 0 a request never waits: blocks
        not yet written to disk are dropped unwritten to make room. Otherwise it waits (with ``wait``)
        up to ``timeout`` seconds (None: ``server.slot_wait_s``) for the writer to clean blocks, then
        drops unwritten ones. ``drop_dirty`` False: only clean blocks ever make room (a prefetch must
        not cost a block its disk copy). Lock held.

        Raises:
            TierFull: every block is leased, moving or pinned (after the wait), or the daemon is closing.
        """
        hp = self.hostp
        deadline = None
        while True:
            off = hp.alloc_free(slot)
            if off is not None:
                if hp.above_high():
                    self.evictor.kick()
                return off
            if self.closing:
                raise TierFull("daemon is shutting down")
            if hp.evict_for(slot):
                self.changed.notify_all()
                continue
            now = time.monotonic()
            if deadline is None:
                deadline = now + (self.cfg.server.slot_wait_s if timeout is None else max(0.0, timeout))
            if drop_dirty and now >= deadline and hp.drop_unwritten(slot):
                self.changed.notify_all()
                self.evictor.kick()
                continue
            if not wait or now >= deadline or not hp.evictable_exists():
                raise TierFull("host tier is full: every block is leased, moving or pinned")
            self.evictor.kick(force=True)
            self.changed.wait(min(0.05, max(0.001, deadline - now)))

    def host_tensor(self, offset: int, nbytes: int) -> Any:
        """A torch view of a host slot, sliced from one tensor over the whole pool: slots adjacent in
        the pool are then adjacent in one storage, and the copy queues merge them into one copy."""
        if self._host_t is None:
            import torch

            self._host_t = torch.from_numpy(self.host.array)
        return self._host_t[offset:offset + nbytes]

    def set_config(self, cfg: Config) -> None:
        """New settings for every decision that reads them (``tierkv tune``). Lock held."""
        self.cfg = self.diskp.cfg = self.hostp.cfg = cfg

    def _requested(self, s: Session, keys: list[bytes]) -> None:
        """A request uses its prefix chain ``keys`` (fetch, acquire, prefetch; a lookup is only a
        query, and clients mostly answer it from the shared index): the reuse models learn from it."""
        fks, now = [s.fp + k for k in keys], time.monotonic()
        with self.lock:
            self.host_reuse.requested(fks, now)
            if self.cfg.disk.admission == "predicted":
                self.admission.requested(fks, now)
            if self.disk is not None:
                self.disk_referenced(fks)

    def disk_referenced(self, fks: list[bytes]) -> None:
        """The blocks of chain ``fks`` that host memory does not hold are the disk tier's references
        (its policy's shadow compares orders on them). Lock held."""
        if getattr(self.diskp.policy, "shadow", None) is None:
            return  # no shadow to feed (another policy, or disk.order_shadow_rate 0): no walk per request
        ref, table, parent = self.diskp.policy.referenced, self.table, None
        for fk in fks:
            b = table.get(fk)
            if b is None or b.host_off is None:
                ref(fk, parent)
            parent = fk

    # ---- connections ------------------------------------------------------------------------------
    def register(self, s: Session, ns: Namespace) -> None:
        """Bind a connection to its namespace (once: its slots and leases are sized for it)."""
        slot = slot_size_for(ns.layout.block_bytes)
        if slot > self.host.slab_bytes:
            raise BadRequest(f"a block of {ns.layout.block_bytes} bytes exceeds the host slab size "
                             f"({self.host.slab_bytes}); raise host.slab_bytes")
        with self.lock:
            self.table.bind(s, ns)

    def close_session(self, s: Session) -> None:
        """Release everything a connection held (it may have died without a word)."""
        with self.lock:
            self.table.drop_leases(s)
            for off in s.slots:
                self.host.free(off)
            s.slots.clear()
            for off in s.gpu_slots:
                assert self.gpu is not None  # the connection holds GPU slots: the GPU tier is on
                self.gpu.free(off)
            s.gpu_slots.clear()
            self.table.unbind(s)
            self.changed.notify_all()

    # ---- store path -------------------------------------------------------------------------------
    def alloc(self, s: Session, n: int, keys: list[bytes] | None = None, tier: str = "host",
              timeout: float | None = None) -> list[int | None]:
        """Slots of ``tier`` for ``n`` new blocks (None where ``keys[i]`` is already cached); a host slot
        waits at most ``timeout`` seconds for blocks in use (None: ``server.slot_wait_s``)."""
        return self.store_path.alloc(s, self.ns(s), n, keys, tier, timeout)

    def commit(self, s: Session, keys: list[bytes], offsets: list[int], durable: bool = False,
               tier: str = "host", wait: bool = True, chains: dict[int, bytes | None] | None = None,
               remote: bool = False, tokens: list[bytes] | None = None) -> int:
        """Publish written slots under ``keys``; returns how many were new (the rest deduplicated).
        ``keys`` are prefix chains, each key the child of the one before except at the indexes of
        ``chains``, where a chain continues the key given (None: starts one; default ``{0: None}``).
        ``durable`` with ``wait=False`` (host tier): return once the disk write is queued; :meth:`sync`
        waits for it (a client streams a large durable put: its next copy overlaps this write).
        ``remote``: every block is written through, admitted or not, before the return (if writable).
        ``tokens``: each block's token ids (int32), kept for KV events when they are on."""
        ns = self.ns(s)
        if self.events is None:
            tokens = None
        if len(keys) != len(offsets):
            raise BadRequest("keys and slots differ in length")
        if durable and self.disk is None:
            raise BadRequest("durable=True needs the disk tier, which is disabled")
        if self.tier(tier) == "gpu":
            return self.store_path.commit_gpu(s, ns, keys, offsets, durable, remote, tokens)
        return self.store_path.commit(s, ns, keys, offsets, durable, wait, chains or {0: None}, remote, tokens)

    def sync(self, s: Session) -> None:
        """Wait for the durable writes this connection committed with ``wait=False``."""
        self.store_path.sync(s)

    def abort(self, s: Session, offsets: list[int], tier: str = "host") -> None:
        """Give back allocated slots without committing them."""
        self.store_path.abort(s, offsets, self.tier(tier) == "gpu")

    # ---- load path --------------------------------------------------------------------------------
    def lookup(self, s: Session, keys: list[bytes]) -> list[str]:
        """Tier of each leading cached block; stops at the first miss."""
        self.ns(s)
        return self.fetch_path.lookup(s.fp, keys)

    def lookup_tokens(self, model: str, tp_rank: int, tokens: list[int]) -> dict:
        """For a router: the leading tokens of prompt ``tokens`` each tier holds
        (:func:`~tierkv.core.prefix.tier_tokens`), keyed in the namespace a connected engine of ``model``
        registered at ``tp_rank``.

        Raises:
            BadRequest: no connected engine of that model at that rank.
        """
        with self.lock:
            ns = next((n for n in self.table.namespaces.values() if n.model == model and n.tp_rank == tp_rank), None)
        if ns is None:
            raise BadRequest(f"no connected engine serves model {model!r} at TP rank {tp_rank}")
        bt = ns.layout.block_tokens
        keys = chain_keys(ns.fingerprint, tokens, bt)
        return tier_tokens(self.fetch_path.lookup(ns.fingerprint, keys) if keys else [], bt, len(tokens))

    def lookup_count(self, s: Session, keys: list[bytes]) -> int:
        """``len(self.lookup(s, keys))`` without naming the tiers."""
        self.ns(s)
        return self.fetch_path.lookup_count(s, keys)

    def acquire(self, s: Session, keys: list[bytes], tier: str = "host") -> tuple[int, list[int], list[str]]:
        """Lease the longest cached prefix in host (or GPU) memory, promoting as needed.

        Returns:
            (lease id, slot offsets of the leased prefix, tier each block came from).
        """
        return self.wait(s, self.fetch(s, keys, tier), None)

    def fetch(self, s: Session, keys: list[bytes], tier: str = "host") -> int:
        """Start leasing the cached prefix of ``keys``; returns a ticket for :meth:`wait`. Never blocks
        on the disk. With ``tier="gpu"`` the lease is on GPU slots, promoted in the background."""
        ns = self.ns(s)
        self._requested(s, keys)
        if self.tier(tier) != "gpu":
            return self.fetch_path.fetch(s, ns, keys)
        assert self.gpu_path is not None  # self.tier checked that the GPU tier is on
        leased, tiers = self.gpu_path.promote(s, ns, keys, lease=True)
        with self.lock:
            self.table.count_fetch(s.fp, len(keys), len(leased))
            return self.table.open_ticket(s, leased, tiers, "gpu")

    def wait(self, s: Session, ticket: int, timeout: float | None) -> tuple[int, list[int], list[str]]:
        """Turn a ticket into a lease on the prefix that arrived within ``timeout`` seconds."""
        return self.fetch_path.wait(s, ticket, timeout)

    def prefetch(self, s: Session, keys: list[bytes], tier: str = "host") -> int:
        """Warm the cached prefix in host (or GPU) memory in the background; returns loads started."""
        ns = self.ns(s)
        self._requested(s, keys)
        if self.tier(tier) == "gpu":
            assert self.gpu_path is not None  # self.tier checked that the GPU tier is on
            return len(self.gpu_path.promote(s, ns, keys, lease=False)[0])
        return self.fetch_path.prefetch(s, ns, keys)

    def plan(self, s: Session, keys: list[bytes]) -> dict:
        """Where the cached prefix is and how much of it is worth fetching rather than recomputing."""
        return self.fetch_path.plan(s, self.ns(s), keys)

    def release(self, s: Session, lease_ids: Iterable[int]) -> None:
        """End leases; unknown ids (double release, another client's lease) are an error."""
        with self.lock:
            self.table.release(s, lease_ids)
            self.changed.notify_all()

    # ---- signals from the engine ------------------------------------------------------------------
    def touch(self, s: Session, keys: list[bytes], scores: list[float]) -> int:
        """Record attention mass per block (1.0 = uniform) for the policies; returns blocks found."""
        self.ns(s)
        found = 0
        with self.lock:
            for k, mass in zip(keys, scores):
                b = self.table.get(s.fp + k)
                if b is None:
                    continue
                found += 1
                b.mass = mass
                if b.fk in self.hostp.policy:
                    self.hostp.policy.on_touch(b.fk, mass)
                if b.on_disk:
                    self.diskp.policy.on_touch(b.fk, mass)
        return found

    def request_finished(self, s: Session, keys: list[bytes], output_tokens: int | None = None) -> int:
        """The engine finished a request whose prompt and output chain is ``keys`` (``output_tokens``
        generated, if it says): a conversation tail its next turn may extend. Returns how many of the
        keys are cached."""
        fks = [s.fp + k for k in keys]
        with self.lock:
            now = time.monotonic()
            self.host_reuse.request_finished(fks, now, output_tokens)
            self.admission.request_finished(fks, now, output_tokens)
            return sum(1 for fk in fks if fk in self.table)

    def delete(self, s: Session, keys: list[bytes]) -> int:
        """Drop blocks from every tier (leased or in-flight ones are skipped); returns blocks dropped."""
        self.ns(s)
        gone: list[bytes] = []
        with self.lock:
            for k in keys:
                b = self.table.get(s.fp + k)
                if b is None or b.busy:
                    continue
                if b.gpu_off is not None:
                    assert self.gpu is not None and self.gpup is not None  # b holds a GPU slot
                    self.gpup.policy.on_remove(b.fk)
                    self.gpu.free(b.gpu_off)
                    b.gpu_off = None
                if b.host_off is not None:
                    self.hostp.policy.on_remove(b.fk)
                    self.host.free(b.host_off)
                    b.host_off = None
                if b.on_disk:
                    gone.append(b.fk)
                self.diskp.forget(b)
            self.changed.notify_all()
        if gone and self.disk is not None:
            self.disk.delete(gone)
        return len(keys) - sum(1 for k in keys if (s.fp + k) in self.table)

    # ---- pinned prefixes and windows --------------------------------------------------------------
    def pin_prefix(self, s: Session, keys: list[bytes], priority: int) -> int:
        """Keep ``keys`` in the host tier until unpinned (:func:`tierkv.daemon.retention.pin_prefix`)."""
        return retention.pin_prefix(self, s, keys, priority)

    def unpin(self, s: Session, keys: list[bytes]) -> int:
        """Make pinned blocks evictable again; returns blocks unpinned."""
        return retention.unpin(self, s, keys)

    def window(self, s: Session, keys: list[bytes], budget: int, sinks: int, recent: int) -> int:
        """Fit a live sequence into ``budget`` host blocks; returns how many blocks were demoted."""
        return retention.window(self, s, keys, budget, sinks, recent)

    # ---- operator requests ------------------------------------------------------------------------
    def apply(self, new: Config, changed: set[str]) -> None:
        """Apply changed settings to the running tiers; a bad value raises ``ValueError``, nothing changes."""
        tuning.apply(self, new, changed)

    def verify(self, drop: bool = False) -> dict:
        """Decode every disk value; report bad ones and optionally drop them."""
        return self.transfers.verify(drop)

    def snapshot(self) -> dict[str, Any]:
        """Leases, lookup index, health, tiers, namespaces and transfers, for ``tierkv stats``."""
        return snapshot.store_snapshot(self)

    def health(self) -> str:
        """Why the store is degraded ("" when healthy)."""
        reason = self.degraded
        if self.remote is not None and self.remote.state()["state"] != "up":
            reason = reason or f"remote tier {self.remote.state()['state']}"
        return reason

    # ---- shutdown ---------------------------------------------------------------------------------
    def flush(self, timeout: float) -> int:
        """Write every dirty host block to disk (a warm next start); returns blocks written."""
        if self.disk is None:
            return 0
        deadline = time.monotonic() + timeout
        with self.lock:  # GPU commits first reach host memory (the drain), then the disk
            if self.gpu_path is not None:
                self.gpu_path.retry_drains()
            while any(b.draining for b in self.table.records()) and time.monotonic() < deadline:
                self.changed.wait(0.05)
            dirty = [b for b in self.table.records() if b.host_ready and not b.on_disk and not b.writing]
            batch = self.cfg.disk.write_batch
            jobs = [self.transfers.store(dirty[i:i + batch]) for i in range(0, len(dirty), batch)]
        for j in jobs:
            j.wait(max(0.0, deadline - time.monotonic()))
        return sum(1 for j in jobs if j.done.is_set() and j.error is None for m in j.moves if m.ok)

    def learned_models(self) -> dict[str, ReuseModel]:
        """The reuse models whose class counts are kept across restarts."""
        return {"host": self.host_reuse, "disk": self.admission.model,
                "disk-eviction": self.admission.evict_model, "disk-floor": self.admission.floor_model}

    def close(self, timeout: float) -> None:
        """Keep what the reuse models learned, stop threads, finish in-flight writes, close LMDB and
        the pools."""
        with self.lock:
            learned.save(self.learned_models(), self.data_dir)
        self.closing = True
        self.evictor.stop()
        self.engine.close(timeout)
        if self.events is not None:
            self.events.close()
        self.tiers.close()
        self.table.close()

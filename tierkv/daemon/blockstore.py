"""The block store: the wiring of the daemon's tiers, the block table, the placements over them, the
transfer engine and the paths that use them. Every request handler calls one public method here; each
delegates to the object that owns the work: :mod:`~tierkv.daemon.storepath` (alloc, commit),
:mod:`~tierkv.daemon.fetchpath` (lookup, fetch, wait), :mod:`~tierkv.daemon.gpupath` (drains,
promotions), :mod:`~tierkv.daemon.slots`, :mod:`~tierkv.daemon.retention` (pins, windows, deletes),
:mod:`~tierkv.daemon.signals`, :mod:`~tierkv.daemon.sessions`, :mod:`~tierkv.daemon.evictor` (and the
shutdown flush), :mod:`~tierkv.daemon.tuning`, :mod:`~tierkv.daemon.snapshot` and
:mod:`~tierkv.daemon.scrub`. All of them share one :class:`~tierkv.daemon.context.Context` (lock,
condition, settings, closing flag); waits on transfers happen outside the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tierkv.cache.block import Session
from tierkv.cache.counters import TierCounters
from tierkv.cache.placement import DiskPlacement, GpuPlacement, HostPlacement
from tierkv.cache.policy import History
from tierkv.cache.policy import make_policy as _lru
from tierkv.cache.policy.placement import Placement
from tierkv.cache.policy.reuse import ReuseModel
from tierkv.cache.table import BlockTable
from tierkv.core.keys import Namespace
from tierkv.daemon import learned, scrub
from tierkv.daemon.config import Config
from tierkv.daemon.context import Context
from tierkv.daemon.events import open_events
from tierkv.daemon.evictor import Evictor
from tierkv.daemon.fetchpath import FetchPath
from tierkv.daemon.gpupath import GpuPath
from tierkv.daemon.retention import Retention
from tierkv.daemon.sessions import Sessions, namespace
from tierkv.daemon.signals import Signals, learned_models
from tierkv.daemon.slots import Slots
from tierkv.daemon.snapshot import Snapshots
from tierkv.daemon.startup import make_disk_policy, make_host_policy, open_tiers
from tierkv.daemon.storepath import StorePath
from tierkv.daemon.transfers import Transfers
from tierkv.daemon.tuning import Tuner
from tierkv.movers.transfer import TransferEngine
from tierkv.tiers.disk import stored_size

if TYPE_CHECKING:
    from tierkv.tiers.gpu import DevicePool

HISTORY_ENTRIES = 1 << 16


class BlockStore:
    """All blocks of one daemon, in every tier it runs."""

    evictor: Evictor
    gpu: DevicePool | None

    def __init__(self, cfg: Config, data_dir: str) -> None:
        """Open the tiers, rebuild the records of what is on disk and start the evictor."""
        self.ctx = ctx = Context(cfg)
        self.table = table = BlockTable(cfg.server.lookup_index_slots)
        self.tiers = open_tiers(cfg, data_dir)
        self.host, self.disk, self.remote, self.gpu = self.tiers.host, self.tiers.disk, self.tiers.remote, None
        # One use history for both tiers (heat survives demotion), bounded so that a stream of
        # one-shot keys cannot grow the daemon's memory (~150 B a record).
        self.history = History(max_entries=HISTORY_ENTRIES)
        # Which host blocks come back once they leave host memory (the host policy's reuse term). The
        # host policy scores a block while its request runs, before the generated-token count is
        # known, so that count is not one of its classes.
        self.host_reuse = ReuseModel(max_records=HISTORY_ENTRIES, output_edges="")
        # Which host victims reach disk: learned from requests, stores and the engine's signals. Its own
        # history: the policies count uses with decay, admission counts each request once.
        self.admission = Placement(cfg.disk.admission, max_records=HISTORY_ENTRIES,
                                   ghost_entries=HISTORY_ENTRIES // 2, shadow_rate=cfg.disk.shadow_rate)
        self.admission.unit = self.history.branch  # the shadow samples branches, as the host's does
        self.data_dir = data_dir
        learned.load(learned_models(self.host_reuse, self.admission), data_dir)
        self.diskp = DiskPlacement(table, make_disk_policy(cfg, self.history, self.admission.evict_model), cfg,
                                   lambda: self.disk.capacity if self.disk is not None else 0, stored_size)
        self.engine = TransferEngine(self.disk, cfg.disk.workers, cfg.disk.codec, cfg.disk.codec_level,
                                     make_room=self._make_disk_room, write_batch=cfg.disk.write_batch,
                                     budgets={"host<->disk": cfg.budget.host_disk or None,
                                              "gpu<->host": cfg.budget.gpu_host or None,
                                              "host<->remote": cfg.budget.host_remote or None},
                                     write_nice=cfg.disk.write_nice)
        self.hostp = HostPlacement(table, self.host, make_host_policy(cfg, self.history, self.host_reuse),
                                   self.diskp, self.disk is not None, self.host_reuse, self.admission, cfg,
                                   lambda: self.engine.store_backlog() == 0)
        self.remote_stats = TierCounters()
        self.gpup = self._attach_gpu()
        self._wire_paths()
        self.events = open_events(cfg.events, table, ctx.lock, data_dir if self.disk is not None else None)
        self.snapshots = Snapshots(ctx, table, self.tiers, self.hostp, self.diskp, self.gpup, self.host_reuse,
                                   self.admission, self.engine, self.events, self.remote_stats)
        if self.disk is not None:
            scrub.scan_disk(self)
        if self.events is not None:
            self.events.start()
        self.evictor.start()

    def _attach_gpu(self) -> GpuPlacement | None:
        """The GPU tier's placement (device slots are few and clean once drained: plain recency)."""
        gpu = self.tiers.gpu
        if gpu is None:
            return None
        try:
            self.engine.attach_device(gpu, self.host)
        except Exception:
            gpu.close()
            raise
        self.gpu = gpu
        return GpuPlacement(self.table, gpu, _lru("lru"), self.diskp)

    def _wire_paths(self) -> None:
        """Make the paths, each with the few objects it uses."""
        ctx, table, host, hostp, engine, disk_on = self.ctx, self.table, self.host, self.hostp, self.engine, \
            self.disk is not None
        self.transfers = Transfers(self)
        self.evictor = Evictor(ctx, table, hostp, self.transfers, engine, disk_on)
        self.slots = Slots(ctx, hostp, self.gpup, self.evictor.kick)
        self.gpu_path = None if self.gpu is None or self.gpup is None else GpuPath(
            ctx, table, host, self.gpu, self.gpup, hostp, self.slots, self.transfers, engine, self.evictor.kick)
        self.evictor.drains = self.gpu_path
        self.signals = Signals(ctx, table, hostp, self.diskp, self.host_reuse, self.admission, disk_on)
        self.store_path = StorePath(ctx, table, host, hostp, self.slots, self.transfers, self.signals,
                                    self.evictor.kick, disk_on, self.remote, self.gpu_path)
        self.fetch_path = FetchPath(ctx, table, host, hostp, self.slots, self.transfers, self.signals, engine,
                                    self.remote, self.gpu_path)
        self.retention = Retention(ctx, table, host, hostp, self.diskp, self.gpup, self.disk, self.transfers,
                                   self.fetch_path)
        self.sessions = Sessions(ctx, table, host, self.gpu)
        self.tuner = Tuner(ctx, table, host, self.disk, hostp, self.diskp, self.history, self.host_reuse,
                           self.admission, engine, self.evictor.kick)

    def _make_disk_room(self, incoming: int) -> list[bytes]:
        """Called by the disk writer: keys to delete so ``incoming`` bytes fit under the high watermark."""
        with self.ctx.lock:
            return self.diskp.room(incoming)

    # ---- the shared context, as the transfers and the disk checks read it -------------------------
    @property
    def cfg(self) -> Config:
        """The running settings."""
        return self.ctx.cfg

    @property
    def lock(self) -> threading.RLock:
        """The store's lock."""
        return self.ctx.lock

    @property
    def changed(self) -> threading.Condition:
        """The condition waiters wait on (its lock is :attr:`lock`)."""
        return self.ctx.changed

    @property
    def closing(self) -> bool:
        """Whether the store is closing."""
        return self.ctx.closing

    @property
    def degraded(self) -> str:
        """Why the store is degraded ("" when healthy)."""
        return self.ctx.degraded

    @degraded.setter
    def degraded(self, reason: str) -> None:
        self.ctx.degraded = reason

    # ---- connections ------------------------------------------------------------------------------
    def ns(self, s: Session) -> Namespace:
        """The connection's namespace; BadRequest before HELLO."""
        return namespace(s)

    def register(self, s: Session, ns: Namespace) -> None:
        """Bind a connection to its namespace (once: its slots and leases are sized for it)."""
        self.sessions.register(s, ns)

    def close_session(self, s: Session) -> None:
        """Release everything a connection held (it may have died without a word)."""
        self.sessions.close(s)

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
        return self.store_path.commit(s, self.ns(s), keys, offsets, durable, tier, wait, chains, remote,
                                      tokens if self.events is not None else None)

    def sync(self, s: Session) -> None:
        """Wait for the durable writes this connection committed with ``wait=False``."""
        self.store_path.sync(s)

    def abort(self, s: Session, offsets: list[int], tier: str = "host") -> None:
        """Give back allocated slots without committing them."""
        self.store_path.abort(s, offsets, self.slots.tier(tier) == "gpu")

    # ---- load path --------------------------------------------------------------------------------
    def lookup(self, s: Session, keys: list[bytes]) -> list[str]:
        """Tier of each leading cached block; stops at the first miss."""
        self.ns(s)
        return self.fetch_path.lookup(s.fp, keys)

    def lookup_tokens(self, model: str, tp_rank: int, tokens: list[int]) -> dict:
        """For a router: the leading tokens of prompt ``tokens`` each tier holds (see
        :meth:`FetchPath.lookup_tokens`)."""
        return self.fetch_path.lookup_tokens(model, tp_rank, tokens)

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
        return self.fetch_path.fetch(s, self.ns(s), keys, tier)

    def wait(self, s: Session, ticket: int, timeout: float | None) -> tuple[int, list[int], list[str]]:
        """Turn a ticket into a lease on the prefix that arrived within ``timeout`` seconds."""
        return self.fetch_path.wait(s, ticket, timeout)

    def prefetch(self, s: Session, keys: list[bytes], tier: str = "host") -> int:
        """Warm the cached prefix in host (or GPU) memory in the background; returns loads started."""
        return self.fetch_path.prefetch(s, self.ns(s), keys, tier)

    def plan(self, s: Session, keys: list[bytes]) -> dict:
        """Where the cached prefix is and how much of it is worth fetching rather than recomputing."""
        return self.fetch_path.plan(s, self.ns(s), keys)

    def release(self, s: Session, lease_ids: Iterable[int]) -> None:
        """End leases; unknown ids (double release, another client's lease) are an error."""
        self.sessions.release(s, lease_ids)

    # ---- signals from the engine ------------------------------------------------------------------
    def touch(self, s: Session, keys: list[bytes], scores: list[float]) -> int:
        """Record attention mass per block (1.0 = uniform) for the policies; returns blocks found."""
        self.ns(s)
        return self.signals.touch(s, keys, scores)

    def request_finished(self, s: Session, keys: list[bytes], output_tokens: int | None = None) -> int:
        """The engine finished a request whose chain is ``keys``; returns how many of the keys are cached."""
        return self.signals.request_finished(s, keys, output_tokens)

    def delete(self, s: Session, keys: list[bytes]) -> int:
        """Drop blocks from every tier (leased or in-flight ones are skipped); returns blocks dropped."""
        return self.retention.delete(s, keys)

    # ---- pinned prefixes and windows --------------------------------------------------------------
    def pin_prefix(self, s: Session, keys: list[bytes], priority: int) -> int:
        """Keep ``keys`` in the host tier until unpinned (:meth:`Retention.pin_prefix`)."""
        return self.retention.pin_prefix(s, keys, priority)

    def unpin(self, s: Session, keys: list[bytes]) -> int:
        """Make pinned blocks evictable again; returns blocks unpinned."""
        return self.retention.unpin(s, keys)

    def window(self, s: Session, keys: list[bytes], budget: int, sinks: int, recent: int) -> int:
        """Fit a live sequence into ``budget`` host blocks; returns how many blocks were demoted."""
        return self.retention.window(s, keys, budget, sinks, recent)

    # ---- operator requests ------------------------------------------------------------------------
    def apply(self, new: Config, changed: set[str]) -> None:
        """Apply changed settings to the running tiers; a bad value raises ``ValueError``, nothing changes."""
        self.tuner.apply(new, changed)

    def verify(self, drop: bool = False) -> dict:
        """Decode every disk value; report bad ones and optionally drop them."""
        return scrub.verify(self, drop)

    def snapshot(self) -> dict[str, Any]:
        """Leases, lookup index, health, tiers, namespaces and transfers, for ``tierkv stats``."""
        return self.snapshots.store()

    def tier_figures(self) -> list[tuple[str, TierCounters, int, int]]:
        """(tier, counters, used bytes, capacity) per tier, hottest first (the sample ring's read)."""
        return self.snapshots.tier_figures()

    def health(self) -> str:
        """Why the store is degraded ("" when healthy)."""
        state = self.remote.state()["state"] if self.remote is not None else "up"
        return self.ctx.degraded or ("" if state == "up" else f"remote tier {state}")

    # ---- shutdown ---------------------------------------------------------------------------------
    def flush(self, timeout: float) -> int:
        """Write every dirty host block to disk (a warm next start); returns blocks written."""
        return self.evictor.flush(timeout)

    def learned_models(self) -> dict[str, ReuseModel]:
        """The reuse models whose class counts are kept across restarts."""
        return self.signals.learned_models()

    def close(self, timeout: float) -> None:
        """Keep what the reuse models learned, stop threads, finish in-flight writes, close LMDB and
        the pools."""
        with self.ctx.lock:
            learned.save(self.learned_models(), self.data_dir)
        self.ctx.close()
        self.evictor.stop()
        self.engine.close(timeout)
        if self.events is not None:
            self.events.close()
        self.tiers.close()
        self.table.close()

"""The block store: the wiring of the daemon's tiers, block table, placements and transfer engine with
the objects that do the work, which share one :class:`~tierkv.daemon.context.Context` (lock, condition,
settings, closing flag). Every request handler calls one public method here, and each hands the request
to its owner: the store, fetch and GPU paths, the slots, retention, signals, sessions, the evictor (and
the shutdown flush), tuning, snapshots and scrub. Waits on transfers happen outside the lock."""

from __future__ import annotations

import threading
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
from tierkv.daemon.startup import make_admission, make_disk_policy, make_host_policy, open_tiers
from tierkv.daemon.storepath import StorePath
from tierkv.daemon.tier_jobs import TierJobs
from tierkv.daemon.tuning import Tuner
from tierkv.movers.engine import TransferEngine
from tierkv.tiers.disk import stored_size

if TYPE_CHECKING:
    from tierkv.tiers.gpu import DevicePool

HISTORY_ENTRIES = 1 << 16
LeaseReply = tuple[int, list[int], list[str]]  # (lease id, slot offsets of the leased prefix, tier each came from)


class BlockStore:
    """All blocks of one daemon, in every tier it runs."""

    evictor: Evictor
    gpu: DevicePool | None

    def __init__(self, cfg: Config, data_dir: str) -> None:
        """Open the tiers, rebuild the records of what is on disk and start the evictor."""
        self.ctx, self.data_dir = Context(cfg), data_dir
        self.lock, self.changed = self.ctx.lock, self.ctx.changed
        self.table = table = BlockTable(cfg.server.lookup_index_slots)
        self.tiers = open_tiers(cfg, data_dir)
        self.host, self.disk, self.remote, self.gpu = self.tiers.host, self.tiers.disk, self.tiers.remote, None
        # One use history for both tiers (heat survives demotion), bounded (~150 B a record). The host's
        # reuse model has no generated-token classes: it scores a block while its request runs. The
        # admission rule counts each request once (its own history); the policies count uses with decay.
        self.history = History(max_entries=HISTORY_ENTRIES)
        self.host_reuse = host_reuse(HISTORY_ENTRIES)
        self.admission = make_admission(cfg, self.history, HISTORY_ENTRIES)
        learned.load(learned_models(self.host_reuse, self.admission), data_dir)
        self.diskp = DiskPlacement(table, make_disk_policy(cfg, self.history, self.admission.evict_model), cfg,
                                   lambda: self.disk.capacity if self.disk is not None else 0, stored_size)
        self.cost = CostModel(lock=threading.Lock())  # fetch or recompute: fed the rates the loads measure
        self.engine = TransferEngine(self.disk, cfg.disk.workers, cfg.disk.codec, cfg.disk.codec_level,
                                     write_batch=cfg.disk.write_batch,
                                     budgets={"host<->disk": cfg.budget.host_disk or None,
                                              "gpu<->host": cfg.budget.gpu_host or None,
                                              "host<->remote": cfg.budget.host_remote or None},
                                     write_nice=cfg.disk.write_nice)
        if self.remote is not None:
            self.engine.attach_remote(self.remote)
        self.hostp = HostPlacement(table, self.host, make_host_policy(cfg, self.history, self.host_reuse),
                                   self.diskp, self.disk is not None, self.host_reuse, self.admission, cfg,
                                   lambda: self.engine.store_backlog() == 0)
        self.remote_stats = TierCounters()
        self.gpup = self._attach_gpu()
        self._wire()
        if self.disk is not None:
            scrub.scan_disk(self)
        if self.events is not None:
            self.events.start()
        self.evictor.start()

    def _attach_gpu(self) -> GpuPlacement | None:
        """The GPU tier's placement (device slots are few and clean once drained: plain recency)."""
        if (gpu := self.tiers.gpu) is None:
            return None
        try:
            self.engine.attach_device(gpu, self.host)
        except Exception:
            gpu.close()
            raise
        self.gpu = gpu
        return GpuPlacement(self.table, gpu, _lru("lru"), self.diskp)

    def _wire(self) -> None:
        """Make the paths, each with the few objects it uses."""
        ctx, table, host, hostp, diskp, engine = self.ctx, self.table, self.host, self.hostp, self.diskp, self.engine
        disk_on, models = self.disk is not None, (self.host_reuse, self.admission)
        self.transfers = tr = TierJobs(self)
        self.evictor = Evictor(ctx, table, hostp, tr, engine, disk_on)
        kick = self.evictor.kick
        self.slots = Slots(ctx, hostp, self.gpup, kick)
        self.gpu_path = self.evictor.drains = None if self.gpu is None or self.gpup is None else GpuPath(
            ctx, table, host, self.gpu, self.gpup, hostp, self.slots, tr, engine, kick)
        self.signals = Signals(ctx, table, hostp, diskp, *models, disk_on)
        self.store_path = StorePath(ctx, table, host, hostp, self.slots, tr, self.signals, kick, disk_on,
                                    self.remote, self.gpu_path)
        self.fetch_path = FetchPath(ctx, table, host, hostp, self.slots, tr, self.signals, self.cost, self.remote,
                                    self.gpu_path)
        self.retention = Retention(ctx, table, host, hostp, diskp, self.gpup, self.disk, tr, self.fetch_path)
        self.sessions = Sessions(ctx, table, host, self.gpu)
        self.tuner = Tuner(ctx, table, host, self.disk, hostp, diskp, self.history, *models, engine, kick, tr.trim_disk)
        self.events = open_events(ctx.cfg.events, table, ctx.lock, self.data_dir if disk_on else None)
        self.snapshots = Snapshots(ctx, table, self.tiers, hostp, diskp, self.gpup, *models, engine, self.cost, self.events,
                                   self.remote_stats)

    @property
    def cfg(self) -> Config:
        """The running settings."""
        return self.ctx.cfg

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

    # ---- requests: each handed to the object that owns it (see there) -----------------------------
    def ns(self, s: Session) -> Namespace:
        """The connection's namespace; BadRequest before HELLO."""
        return namespace(s)

    def register(self, s: Session, ns: Namespace) -> None:
        """Bind a connection to its namespace."""
        self.sessions.register(s, ns)

    def close_session(self, s: Session) -> None:
        """Release everything a connection held."""
        self.sessions.close(s)

    def alloc(self, s: Session, n: int, keys: list[bytes] | None = None, tier: str = "host",
              timeout: float | None = None) -> list[int | None]:
        """Slots of ``tier`` for ``n`` new blocks (None where ``keys[i]`` is already cached)."""
        return self.store_path.alloc(s, self.ns(s), n, keys, tier, timeout)

    def commit(self, s: Session, keys: list[bytes], offsets: list[int], durable: bool = False,
               tier: str = "host", wait: bool = True, chains: dict[int, bytes | None] | None = None,
               remote: bool = False, tokens: list[bytes] | None = None) -> int:
        """Publish written slots under ``keys`` (:meth:`StorePath.commit`); returns how many were new."""
        return self.store_path.commit(s, self.ns(s), keys, offsets, durable, tier, wait, chains, remote,
                                      tokens if self.events is not None else None)

    def sync(self, s: Session) -> None:
        """Wait for the durable writes this connection committed with ``wait=False``."""
        self.store_path.sync(s)

    def abort(self, s: Session, offsets: list[int], tier: str = "host") -> None:
        """Give back allocated slots without committing them."""
        self.store_path.abort(s, offsets, self.slots.tier(tier) == "gpu")

    def lookup(self, s: Session, keys: list[bytes]) -> list[str]:
        """Tier of each leading cached block; stops at the first miss."""
        self.ns(s)
        return self.fetch_path.lookup(s.fp, keys)

    def lookup_tokens(self, model: str, tp_rank: int, tokens: list[int]) -> dict:
        """For a router: the leading tokens of a prompt each tier holds."""
        return self.fetch_path.lookup_tokens(model, tp_rank, tokens)

    def lookup_count(self, s: Session, keys: list[bytes]) -> int:
        """How many leading blocks are cached."""
        self.ns(s)
        return self.fetch_path.lookup_count(s, keys)

    def acquire(self, s: Session, keys: list[bytes], tier: str = "host") -> LeaseReply:
        """Lease the longest cached prefix in host (or GPU) memory, promoting as needed."""
        return self.wait(s, self.fetch(s, keys, tier), None)

    def fetch(self, s: Session, keys: list[bytes], tier: str = "host") -> int:
        """Start leasing the cached prefix of ``keys``; returns a ticket for :meth:`wait`."""
        return self.fetch_path.fetch(s, self.ns(s), keys, tier)

    def wait(self, s: Session, ticket: int, timeout: float | None) -> LeaseReply:
        """Turn a ticket into a lease on the prefix that arrived within ``timeout`` seconds."""
        return self.fetch_path.wait(s, ticket, timeout)

    def prefetch(self, s: Session, keys: list[bytes], tier: str = "host") -> int:
        """Warm the cached prefix in host (or GPU) memory in the background; returns loads started."""
        return self.fetch_path.prefetch(s, self.ns(s), keys, tier)

    def plan(self, s: Session, keys: list[bytes]) -> dict:
        """Where the cached prefix is and how much of it is worth fetching rather than recomputing."""
        return self.fetch_path.plan(s, self.ns(s), keys)

    def release(self, s: Session, lease_ids: Iterable[int]) -> None:
        """End leases; unknown ids are an error."""
        self.sessions.release(s, lease_ids)

    def touch(self, s: Session, keys: list[bytes], scores: list[float]) -> int:
        """Record attention mass per block for the policies; returns blocks found."""
        self.ns(s)
        return self.signals.touch(s, keys, scores)

    def request_finished(self, s: Session, keys: list[bytes], output_tokens: int | None = None) -> int:
        """The engine finished a request whose chain is ``keys``; returns how many of them are cached."""
        return self.signals.request_finished(s, keys, output_tokens)

    def delete(self, s: Session, keys: list[bytes]) -> int:
        """Drop blocks from every tier (leased or in-flight ones are skipped); returns blocks dropped."""
        return self.retention.delete(s, keys)

    def pin_prefix(self, s: Session, keys: list[bytes], priority: int) -> int:
        """Keep ``keys`` in the host tier until unpinned; returns blocks pinned."""
        return self.retention.pin_prefix(s, keys, priority)

    def unpin(self, s: Session, keys: list[bytes]) -> int:
        """Make pinned blocks evictable again; returns blocks unpinned."""
        return self.retention.unpin(s, keys)

    def window(self, s: Session, keys: list[bytes], budget: int, sinks: int, recent: int) -> int:
        """Fit a live sequence into ``budget`` host blocks; returns how many blocks were demoted."""
        return self.retention.window(s, keys, budget, sinks, recent)

    def apply(self, new: Config, changed: set[str]) -> None:
        """Apply changed settings to the running tiers; a bad value raises ``ValueError``, nothing changes."""
        self.tuner.apply(new, changed)

    def verify(self, drop: bool = False) -> dict:
        """Decode every disk value; report bad ones and optionally drop them."""
        return self.transfers.verify(drop)

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

    def flush(self, timeout: float) -> int:
        """Write every dirty host block to disk (a warm next start); returns blocks written."""
        return self.evictor.flush(timeout)

    def learned_models(self) -> dict[str, ReuseModel]:
        """The reuse models whose class counts are kept across restarts."""
        return self.signals.learned_models()

    def close(self, timeout: float) -> None:
        """Keep what the reuse models learned, stop threads, finish in-flight writes, close LMDB and the pools."""
        with self.ctx.lock:
            learned.save(self.learned_models(), self.data_dir)
        self.ctx.close()
        self.evictor.stop()
        self.engine.close(timeout)
        if self.events is not None:
            self.events.close()
        self.tiers.close()
        self.table.close()

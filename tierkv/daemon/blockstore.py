"""The block store: the wiring of the daemon's tiers, block table, placements and transfer engine with
the objects that do the work, which share one :class:`~tierkv.daemon.context.Context` (lock, condition,
settings, closing flag). The request handlers call those objects directly: the store, fetch and GPU
paths, the slots, retention, signals, sessions, the evictor (and the shutdown flush), tuning, snapshots
and the tier jobs (verify). Here they are only made and connected, and closed in order."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from tierkv.cache.costmodel import CostModel
from tierkv.cache.counters import TierCounters
from tierkv.cache.placement import DiskPlacement, GpuPlacement, HostPlacement
from tierkv.cache.policy import make_policy as _lru
from tierkv.cache.reuse import History
from tierkv.cache.store_gate import StoreGate
from tierkv.cache.table import BlockTable
from tierkv.cache.wiring import host_reuse
from tierkv.daemon import learned, scrub
from tierkv.daemon.busy_cores import BusyCores
from tierkv.daemon.config import Config
from tierkv.daemon.context import Context
from tierkv.daemon.events import open_events
from tierkv.daemon.evictor import Evictor
from tierkv.daemon.fetchpath import FetchPath
from tierkv.daemon.gpupath import GpuPath
from tierkv.daemon.retention import Retention
from tierkv.daemon.sessions import Sessions
from tierkv.daemon.signals import Signals, learned_models
from tierkv.daemon.slots import Slots
from tierkv.daemon.snapshot import Snapshots
from tierkv.daemon.startup import make_admission, make_disk_policy, make_host_policy, open_tiers
from tierkv.daemon.storepath import StorePath
from tierkv.daemon.tier_jobs import TierJobs
from tierkv.daemon.tuning import Tuner
from tierkv.movers.cpu_share import CpuShare
from tierkv.movers.engine import TransferEngine
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
        self.ctx, self.data_dir = Context(cfg), data_dir
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
                                     write_nice=cfg.disk.write_nice, write_idle=cfg.disk.write_idle,
                                     background_idle=cfg.disk.write_behind_idle, cpu_share=self._cpu_share(cfg))
        if self.remote is not None:
            self.engine.attach_remote(self.remote)
        self.hostp = HostPlacement(table, self.host, make_host_policy(cfg, self.history, self.host_reuse),
                                   self.diskp, self.disk is not None, self.host_reuse, self.admission, cfg,
                                   lambda: self.engine.store_backlog() == 0)
        self.diskp.needed_above = self.hostp.holds_children
        self.remote_counters = TierCounters()  # the remote tier's figures (it has no placement)
        self.gpup = self._attach_gpu()
        self._wire()
        if self.disk is not None:
            scrub.save_scan(data_dir, scrub.scan_disk(self.disk, table, self.diskp))
        if self.events is not None:
            self.events.start()
        self.evictor.start()

    def _cpu_share(self, cfg: Config) -> CpuShare:
        """The share of the cores demotions and write-behind take while the engine keeps them busy (as
        ``host.write_behind_idle_cores`` tells busy from idle)."""
        busy = BusyCores()
        return CpuShare(cfg.disk.background_share,
                        lambda: not busy.idle(self.ctx.cfg.host.write_behind_idle_cores or 0.5))

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
        wakeup = threading.Event()  # the evictor's: set by a kick and by every disk write that settles
        self.transfers = tr = TierJobs(ctx, table, host, hostp, diskp, engine, self.cost, self.disk, self.remote,
                                       self.remote_counters, wakeup.set)
        self.evictor = Evictor(ctx, table, hostp, tr, engine, disk_on, wakeup)
        kick = self.evictor.kick
        self.slots = Slots(ctx, hostp, self.gpup, kick)
        self.gpu_path = self.evictor.drains = None if self.gpu is None or self.gpup is None else GpuPath(
            ctx, table, host, self.gpu, self.gpup, hostp, self.slots, tr, engine, kick)
        self.gate = StoreGate(ctx.cfg.store.gate, min_return=ctx.cfg.store.min_return)
        self.signals = Signals(ctx, table, hostp, diskp, *models, disk_on, self.gate, self.cost)
        self.store_path = StorePath(ctx, table, host, hostp, self.slots, tr, self.signals, kick, disk_on,
                                    self.remote, self.gpu_path)
        self.fetch_path = FetchPath(ctx, table, host, hostp, self.slots, tr, self.signals, self.cost, self.remote,
                                    self.gpu_path)
        self.retention = Retention(ctx, table, host, hostp, diskp, self.gpup, self.disk, tr, self.fetch_path)
        self.sessions = Sessions(ctx, table, host, self.gpu)
        self.tuner = Tuner(ctx, table, host, self.disk, hostp, diskp, self.history, *models, engine, kick, tr.trim_disk,
                           self.gate)
        self.events = open_events(ctx.cfg.events, table, ctx.lock, self.data_dir if disk_on else None)
        self.snapshots = Snapshots(ctx, table, self.tiers, hostp, diskp, self.gpup, *models, engine, self.cost, self.events,
                                   self.remote_counters)

    def close(self, timeout: float) -> None:
        """Keep what the reuse models learned, stop threads, finish in-flight writes, close LMDB and the pools."""
        with self.ctx.lock:
            learned.save(self.signals.learned_models(), self.data_dir)
        self.ctx.close()
        self.evictor.stop()
        self.engine.close(timeout)
        if self.events is not None:
            self.events.close()
        self.tiers.close()
        self.table.close()

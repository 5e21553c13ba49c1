"""The block store: the wiring of the daemon's tiers, block table, placements and transfer engine with
the objects that do the work, which share one :class:`~tierkv.daemon.context.Context` (lock, condition,
settings, closing flag). The request handlers call those objects directly: the store, fetch and GPU
paths, the slots, retention, signals, sessions, the evictor (and the shutdown flush), tuning, snapshots
and the tier jobs (verify). Here they are only made and connected, and closed in order."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from tierkv.cache.costmodel import CostModel
from tierkv.cache.disk_manager import DiskManager
from tierkv.cache.gpu_manager import GpuManager
from tierkv.cache.host_manager import HostManager
from tierkv.cache.host_outflow import HostOutflow
from tierkv.cache.managers import TierManagers
from tierkv.cache.policy import make_policy as _lru
from tierkv.cache.quotas import Quotas
from tierkv.cache.remote_manager import RemoteManager
from tierkv.cache.reuse import History
from tierkv.cache.store_gate import StoreGate
from tierkv.cache.table import BlockTable
from tierkv.cache.tier_changes import TierChanges
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
        table = BlockTable(cfg.server.lookup_index_slots)
        self.tiers = open_tiers(cfg, data_dir)
        self.host, self.disk, self.remote, self.gpu = self.tiers.host, self.tiers.disk, self.tiers.remote, None
        # One use history for both tiers (heat survives demotion), bounded (~150 B a record). The host's
        # reuse model has no generated-token classes: it scores a block while its request runs. The
        # admission rule counts each request once (its own history); the policies count uses with decay.
        self.history = History(max_entries=HISTORY_ENTRIES)
        self.host_reuse = host_reuse(HISTORY_ENTRIES)
        self.admission = make_admission(cfg, self.history, HISTORY_ENTRIES)
        learned.load(learned_models(self.host_reuse, self.admission), data_dir)
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
        self.m = self._managers(cfg, table)
        self.table, self.hostm, self.diskm, self.gpum = table, self.m.host, self.m.disk, self.m.gpu
        self._wire()
        if self.disk is not None:
            scrub.save_scan(data_dir, scrub.scan_disk(self.disk, table, self.diskm))
        if self.events is not None:
            self.events.start()
        self.evictor.start()
        self.retention.restore()

    def _managers(self, cfg: Config, table: BlockTable) -> TierManagers:
        """A manager per tier (one whose tier is off says so), and the host tier's outflow to disk."""
        changes, quotas = TierChanges(), Quotas()
        disk = self.disk
        diskm = DiskManager(table, make_disk_policy(cfg, self.history, self.admission.evict_model, self.ctx.clock), cfg.disk,
                            lambda: disk.capacity if disk is not None else 0, stored_size, changes,
                            present=disk is not None, quotas=quotas)
        spare = lambda: self.ctx.cfg.disk.spare_writes and self.engine.store_backlog() == 0  # noqa: E731
        hostm = HostManager(table, self.host, make_host_policy(cfg, self.history, self.host_reuse, self.ctx.clock),
                            diskm, self.host_reuse, self.admission, (cfg.host, cfg.disk), spare, changes, quotas,
                            self.ctx.clock)
        diskm.needed_above = hostm.holds_children
        gpum = GpuManager(table, self._attach_gpu(), _lru("lru"), diskm, changes)
        return TierManagers(table, gpum, hostm, diskm, RemoteManager(changes, self.remote is not None),
                            HostOutflow(hostm, self.admission), changes, quotas)

    def _cpu_share(self, cfg: Config) -> CpuShare:
        """The share of the cores demotions and write-behind take while the engine keeps them busy (as
        ``host.write_behind_idle_cores`` tells busy from idle)."""
        busy = BusyCores()
        return CpuShare(cfg.disk.background_share,
                        lambda: not busy.idle(self.ctx.cfg.host.write_behind_idle_cores or 0.5))

    def _attach_gpu(self) -> DevicePool | None:
        """The GPU tier's device pool, attached to the transfer engine (None: the GPU tier is off)."""
        if (gpu := self.tiers.gpu) is None:
            return None
        try:
            self.engine.attach_device(gpu, self.host)
        except Exception:
            gpu.close()
            raise
        self.gpu = gpu
        return gpu

    def _wire(self) -> None:
        """Make the paths, each with the few objects it uses."""
        ctx, m = self.ctx, self.m
        self.transfers = tr = TierJobs(ctx, m, self.tiers, self.engine, self.cost)
        self.slots = Slots(ctx, m.host, m.gpu)
        self.gpu_path = None if self.gpu is None else GpuPath(ctx, m, self.gpu, self.slots, tr)
        self.evictor = Evictor(ctx, m, tr, self.gpu_path)
        self.gate = StoreGate(ctx.cfg.store.gate, min_return=ctx.cfg.store.min_return,
                              prior_weight=ctx.cfg.store.prior_weight,
                              idle_prior_weight=ctx.cfg.store.idle_prior_weight)
        self.signals = Signals(ctx, m, (self.host_reuse, self.admission), self.gate, self.cost)
        self.store_path = StorePath(ctx, m, self.slots, tr, self.signals)
        self.fetch_path = FetchPath(ctx, m, self.slots, tr)
        self.retention = Retention(ctx, m, tr, self.fetch_path, self.data_dir if m.disk.present else None)
        self.sessions = Sessions(ctx, m, self.host, self.gpu)
        self.tuner = Tuner(ctx, m, tr, (self.history, self.host_reuse, self.admission), self.gate)
        self.events = open_events(ctx.cfg.events, m.table, m.changes, ctx.lock,
                                  self.data_dir if m.disk.present else None)
        self.snapshots = Snapshots(ctx, m, tr, (self.host_reuse, self.admission), self.events)

    def close(self, timeout: float) -> None:
        """Keep what the reuse models learned, stop threads, finish in-flight writes, close LMDB and the pools."""
        with self.ctx.lock:
            learned.save(self.signals.learned_models(), self.data_dir)
        self.retention.at_stop(timeout)
        self.ctx.close()
        self.evictor.stop()
        self.engine.close(timeout)
        if self.events is not None:
            self.events.close()
        self.tiers.close()
        self.table.close()

"""Runtime tuning: apply changed settings (``tierkv tune``) to the running store, checking the rules of
:mod:`tierkv.cache.tuning` first so that a bad value changes nothing."""

from __future__ import annotations

from collections.abc import Callable

from tierkv.cache import tuning
from tierkv.cache.admission import Admission
from tierkv.cache.placement import DiskPlacement, HostPlacement
from tierkv.cache.policy import Policy
from tierkv.cache.reuse import History, ReuseModel
from tierkv.cache.store_gate import StoreGate
from tierkv.cache.table import BlockTable
from tierkv.daemon.config import Config
from tierkv.daemon.context import Context
from tierkv.daemon.startup import make_disk_policy, make_host_policy
from tierkv.movers.engine import TransferEngine
from tierkv.tiers.disk import DiskTier, stored_size
from tierkv.tiers.host import HostPool


class Tuner:
    """Applies new settings to the placements, the policies, the tiers and the transfer engine."""

    def __init__(self, ctx: Context, table: BlockTable, host: HostPool, disk: DiskTier | None,
                 hostp: HostPlacement, diskp: DiskPlacement, history: History, host_reuse: ReuseModel,
                 admission: Admission, engine: TransferEngine, kick: Callable[[bool], None],
                 trim_disk: Callable[[], object], gate: StoreGate) -> None:
        """``kick(force)`` asks the evictor to run soon (a smaller host tier demotes at once);
        ``trim_disk()`` starts the deletes that bring the disk tier under its high watermark."""
        self.ctx = ctx
        self.table = table
        self.host = host
        self.disk = disk
        self.hostp = hostp
        self.diskp = diskp
        self.history = history
        self.host_reuse = host_reuse
        self.admission = admission
        self.engine = engine
        self.kick = kick
        self.trim_disk = trim_disk
        self.gate = gate

    def set_config(self, cfg: Config) -> None:
        """New settings for every decision that reads them. Lock held."""
        self.ctx.cfg = self.diskp.cfg = self.hostp.cfg = cfg

    def apply(self, new: Config, changed: set[str]) -> None:
        """Apply changed settings to the running tiers.

        Raises:
            ValueError: a value the running daemon cannot take (nothing changed).
        """
        disk, engine = self.disk, self.engine
        tuning.check_capacities(new, changed, self.host.capacity, disk.capacity if disk is not None else None,
                                disk.map_size if disk is not None else 0)
        host_policy = disk_policy = None
        if tuning.policy_changed("host", changed):
            host_policy = make_host_policy(new, self.history, self.host_reuse)
        if tuning.policy_changed("disk", changed):
            disk_policy = make_disk_policy(new, self.history, self.admission.evict_model)
        with self.ctx.lock:
            if host_policy is not None:
                self._swap_host_policy(host_policy)
            if disk_policy is not None:
                self._swap_disk_policy(disk_policy)
            self.set_config(new)
            self.admission.update(mode=new.disk.admission, shadow_rate=new.disk.shadow_rate)
            self.gate.update(mode=new.store.gate, min_return=new.store.min_return)
            self.hostp.limit = min(self.host.capacity, new.host.capacity)
            if disk is not None:
                disk.capacity = new.disk.capacity
            if engine.cpu_share is not None:
                engine.cpu_share.share = new.disk.background_share
            engine.writes.codec = new.disk.codec
            engine.writes.level = new.disk.codec_level
            engine.budgets.set_rate("host<->disk", new.budget.host_disk or None)
            engine.budgets.set_rate("gpu<->host", new.budget.gpu_host or None)
            engine.budgets.set_rate("host<->remote", new.budget.host_remote or None)
        self.kick(self.host.used_bytes > new.host.high_watermark * self.hostp.limit)
        if disk is not None and self.diskp.used > new.disk.high_watermark * new.disk.capacity:
            self.trim_disk()  # the disk shrinks to its new size

    def _swap_host_policy(self, policy: Policy) -> None:
        """Same policy: new weights; another: it takes over every ready host block. Lock held."""
        hp = self.hostp
        if policy.name == hp.policy.name:
            hp.policy.update(**policy.settings())
            return
        for b in self.table.records():
            if b.host_off is not None and b.loading is None:
                policy.on_insert(b.fk, self.host.slot_size_at(b.host_off), b.parent)
        hp.policy = policy

    def _swap_disk_policy(self, policy: Policy) -> None:
        """Same policy: new weights (and reuse factor); another: it takes over every block on disk. Lock held."""
        current = self.diskp.policy
        if policy.name == current.name:
            if hasattr(policy, "reuse") and hasattr(current, "reuse"):  # one class: both have it or neither
                current.reuse = policy.reuse
            current.update(**policy.settings())
            return
        for b in self.table.records():
            if b.on_disk:
                policy.on_insert(b.fk, stored_size(b.disk_bytes), b.parent)
        self.diskp.policy = policy

"""Runtime tuning: apply changed settings (``tierkv tune``) to the running store, checking the rules of
:mod:`tierkv.cache.tuning` first so that a bad value changes nothing."""

from __future__ import annotations

from tierkv.cache import tuning
from tierkv.cache.admission import Admission
from tierkv.cache.managers import TierManagers
from tierkv.cache.policy import Policy
from tierkv.cache.reuse import History, ReuseModel
from tierkv.cache.store_gate import StoreGate
from tierkv.daemon.config import Config
from tierkv.daemon.context import Context
from tierkv.daemon.startup import make_disk_policy, make_host_policy
from tierkv.daemon.tier_jobs import TierJobs
from tierkv.tiers.disk import stored_size


class Tuner:
    """Applies new settings to the placements, the policies, the tiers and the transfer engine."""

    def __init__(self, ctx: Context, m: TierManagers, transfers: TierJobs, models: tuple[History, ReuseModel, Admission],
                 gate: StoreGate) -> None:
        """The managers and the tiers that take new settings (through the tier jobs, which also trim the
        disk), the use history and reuse models new policies are built on, and the store gate."""
        self.ctx = ctx
        self.m = m
        self.table = m.table
        self.host = transfers.host
        self.disk = transfers.disk
        self.hostm = m.host
        self.diskm = m.disk
        self.history, self.host_reuse, self.admission = models
        self.engine = transfers.engine
        self.trim_disk = transfers.trim_disk
        self.gate = gate

    def set_config(self, cfg: Config) -> None:
        """New settings for every decision that reads them. Lock held."""
        self.ctx.cfg = cfg
        self.hostm.configure(cfg.host, cfg.disk)
        self.diskm.configure(cfg.disk)

    def apply(self, new: Config, changed: set[str]) -> None:
        """Apply changed settings to the running tiers.

        Raises:
            ValueError: a value the running daemon cannot take (nothing changed).
        """
        disk, engine = self.disk, self.engine
        tuning.check_capacities((new.host, new.disk), changed, self.host.capacity, disk.capacity if disk is not None else None,
                                disk.map_size if disk is not None else 0)
        host_policy = disk_policy = None
        if tuning.policy_changed("host", changed):
            host_policy = make_host_policy(new, self.history, self.host_reuse, self.ctx.clock)
        if tuning.policy_changed("disk", changed):
            disk_policy = make_disk_policy(new, self.history, self.admission.evict_model, self.ctx.clock)
        with self.ctx.lock:
            if host_policy is not None:
                self._swap_host_policy(host_policy)
            if disk_policy is not None:
                self._swap_disk_policy(disk_policy)
            self.set_config(new)
            self.admission.update(mode=new.disk.admission, shadow_rate=new.disk.shadow_rate)
            self.gate.update(mode=new.store.gate, min_return=new.store.min_return,
                             prior_weight=new.store.prior_weight,
                             idle_prior_weight=new.store.idle_prior_weight)
            if disk is not None:
                disk.capacity = new.disk.capacity
            if engine.cpu_share is not None:
                engine.cpu_share.share = new.disk.background_share
            engine.writes.codec = new.disk.codec
            engine.writes.level = new.disk.codec_level
            engine.budgets.set_rate("host<->disk", new.budget.host_disk or None)
            engine.budgets.set_rate("gpu<->host", new.budget.gpu_host or None)
            engine.budgets.set_rate("host<->remote", new.budget.host_remote or None)
        self.ctx.kick(self.host.used_bytes > new.host.high_watermark * self.hostm.limit)
        if disk is not None and self.diskm.used > new.disk.high_watermark * new.disk.capacity:
            self.trim_disk()  # the disk shrinks to its new size

    def _swap_host_policy(self, policy: Policy) -> None:
        """Same policy: new weights; another: it takes over every ready host block. Lock held."""
        hp = self.hostm
        if policy.name == hp.policy.name:
            hp.policy.update(**policy.settings())
            return
        for b in self.table.records():
            if b.host_off is not None and b.loading is None:
                policy.on_insert(b.fk, self.host.slot_size_at(b.host_off), b.parent)
        hp.policy = policy

    def _swap_disk_policy(self, policy: Policy) -> None:
        """Same policy: new weights (and reuse factor); another: it takes over every block on disk. Lock held."""
        current = self.diskm.policy
        if policy.name == current.name:
            current.reuse = policy.reuse
            current.update(**policy.settings())
            return
        for b in self.table.records():
            if b.on_disk:
                policy.on_insert(b.fk, stored_size(b.disk_bytes), b.parent)
        self.diskm.policy = policy

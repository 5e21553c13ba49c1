"""Start-up: the tiers a daemon opens from its settings (host pool, LMDB, GPU pool, remote client),
and each tier's policy built from the configured weights."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tierkv.cache import wiring
from tierkv.cache.admission import Admission
from tierkv.cache.policy import Policy
from tierkv.cache.reuse import History, ReuseModel
from tierkv.cache.wiring import Clock
from tierkv.daemon.config import Config
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.host import HostPool

if TYPE_CHECKING:
    from tierkv.tiers.gpu import DevicePool
    from tierkv.tiers.remote import RemoteTier


@dataclass
class Tiers:
    """The opened tiers; ``disk``, ``gpu`` and ``remote`` are None when off."""

    host: HostPool
    disk: DiskTier | None
    gpu: DevicePool | None
    remote: RemoteTier | None

    def close(self) -> None:
        """Close every tier (the reverse of opening them)."""
        if self.remote is not None:
            self.remote.close()
        if self.disk is not None:
            self.disk.close()
        if self.gpu is not None:
            self.gpu.close()
        self.host.close()


def open_tiers(cfg: Config, data_dir: str) -> Tiers:
    """Create the host pool and open the tiers ``cfg`` turns on."""
    host = HostPool(cfg.host.capacity, cfg.host.slab_bytes, cfg.host.prefault)
    disk = None
    if cfg.disk.enabled:
        from tierkv.core.faults import disk_fault_from_env

        disk = DiskTier(Path(data_dir) / "disk", cfg.disk.capacity, cfg.disk.sync)
        disk.fault = disk_fault_from_env()
    gpu = None
    if cfg.gpu.capacity:
        from tierkv.tiers.gpu import DevicePool

        gpu = DevicePool(cfg.gpu.capacity, min(cfg.gpu.slab_bytes, cfg.gpu.capacity), cfg.gpu.device)
    remote = None
    if cfg.remote.url:
        from tierkv.tiers.remote import RemoteTier

        remote = RemoteTier.from_config(cfg.remote)
    return Tiers(host, disk, gpu, remote)


def make_host_policy(cfg: Config, history: History, reuse: ReuseModel, clock: Clock = time.monotonic) -> Policy:
    """The host tier's policy from the daemon's settings (:func:`tierkv.cache.wiring.host_policy`) on the
    decisions' ``clock``: the ``[policy]`` weights, weighted by the host's own reuse model, with the LRU
    shadow of ``host.shadow_rate``."""
    name = cfg.host.policy
    return wiring.host_policy(name, cfg.policy_settings(name), {"shadow_rate": cfg.host.shadow_rate},
                              clock=clock, history=history, reuse=reuse)


def make_disk_policy(cfg: Config, history: History, evict_model: ReuseModel,
                     clock: Clock = time.monotonic) -> Policy:
    """The disk tier's policy from the daemon's settings (:func:`tierkv.cache.wiring.colder_policy`) on the
    decisions' ``clock``: weighted by the admission rule's eviction model under ``predicted``
    ``disk.admission``, aged by ``disk.idle_aging``, with the LRU shadow of ``disk.order_shadow_rate`` fed
    by the disk's references."""
    name = cfg.disk.policy
    return wiring.colder_policy(name, cfg.policy_settings(name),
                                {"idle_aging": cfg.disk.idle_aging, "shadow_rate": cfg.disk.order_shadow_rate},
                                evict_model=evict_model, mode=cfg.disk.admission, clock=clock, history=history)


def make_admission(cfg: Config, history: History, records: int) -> Admission:
    """The disk's admission rule from the daemon's settings (``disk.admission``, ``disk.shadow_rate``):
    its models remember ``records`` blocks and half as many departures; the shadow samples branches."""
    return wiring.admission_rule(cfg.disk.admission, {"shadow_rate": cfg.disk.shadow_rate},
                                 ghost_entries=records // 2, max_records=records, unit=history.branch)

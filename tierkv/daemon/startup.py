"""Start-up: the tiers a daemon opens from its settings (host pool, LMDB, GPU pool, remote client),
and each tier's policy built from the configured weights."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierkv.cache.policy import Policy, policy_class
from tierkv.cache.policy import make_policy as _make
from tierkv.cache.reuse import History, ReuseModel
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


def make_policy(name: str, cfg: Config, history: History, reuse: ReuseModel | None = None,
                overrides: dict[str, Any] | None = None) -> Policy:
    """A tier's policy with the configured weights (and the tier's own ``overrides`` of those the
    policy has), sharing the store's history where it keeps one; with ``reuse`` it also weighs blocks
    by the learned chance that they come back (the host tier by its own model, the disk tier by the
    admission rule's)."""
    kwargs = cfg.policy_settings(name)
    known = policy_class(name).SETTINGS
    kwargs.update({k: v for k, v in (overrides or {}).items() if k in known})
    params = inspect.signature(policy_class(name)).parameters
    if "history" in params:
        kwargs["history"] = history
    if reuse is not None and "reuse" in params:
        kwargs["reuse"] = reuse.predictor(time.monotonic)
    return _make(name, **kwargs)


def make_host_policy(cfg: Config, history: History, reuse: ReuseModel) -> Policy:
    """The host tier's policy: weighted by the host's own reuse model, with the LRU shadow of
    ``host.shadow_rate``."""
    return make_policy(cfg.host.policy, cfg, history, reuse, {"shadow_rate": cfg.host.shadow_rate})


def make_disk_policy(cfg: Config, history: History, evict_model: ReuseModel) -> Policy:
    """The disk tier's policy: weighted by the admission rule's eviction model
    (:attr:`Admission.evict_model`) under ``predicted`` admission, aged by ``disk.idle_aging``, with the
    LRU shadow of ``disk.order_shadow_rate`` fed by the disk's references."""
    reuse = evict_model if cfg.disk.admission == "predicted" else None
    policy = make_policy(cfg.disk.policy, cfg, history, reuse,
                         {"idle_aging": cfg.disk.idle_aging, "shadow_rate": cfg.disk.order_shadow_rate})
    if hasattr(policy, "shadow_on_requests"):  # the policies with an LRU shadow (it is read by them only)
        policy.shadow_on_requests = True
    return policy

"""Tuning rules: which settings ``tierkv tune`` may change on a running daemon, and what each change
rebuilds. Data and plain checks; :mod:`tierkv.daemon.tuning` applies them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierkv.daemon.sections import DiskConfig, HostConfig

# Settings fixed at start-up: they shape the pool, the socket, the LMDB environment or the observers.
RESTART_ONLY = frozenset({
    "server.socket", "server.data_dir", "server.allow_uids", "server.max_frame_bytes", "server.max_clients",
    "server.lookup_index_slots", "server.metrics_addr", "server.sample_interval_s", "server.sample_count",
    "host.slab_bytes", "host.prefault", "disk.enabled", "disk.workers", "disk.sync",
    "gpu.capacity", "gpu.device", "gpu.slab_bytes",
})

# A change to one of these keys (or any ``policy.*`` weight) rebuilds or updates that tier's policy
# (the disk policy is weighted by the admission rule's model under ``predicted`` admission).
POLICY_KEYS = {"host": frozenset({"host.policy", "host.shadow_rate"}),
               "disk": frozenset({"disk.policy", "disk.admission", "disk.idle_aging", "disk.order_shadow_rate"})}


def check_restart_only(key: str) -> None:
    """Raise ``ValueError`` for a setting that only a restart changes."""
    if key in RESTART_ONLY:
        raise ValueError(f"{key} is fixed at start-up; change it in the config and restart")


def policy_changed(tier: str, changed: set[str]) -> bool:
    """Whether ``changed`` settings touch ``tier``'s policy (its name or any policy weight)."""
    return bool(POLICY_KEYS[tier] & changed) or any(c.startswith("policy.") for c in changed)


def check_capacities(new: tuple[HostConfig, DiskConfig], changed: set[str], host_pool: int,
                     disk_capacity: int | None, disk_map: int) -> None:
    """Capacities only shrink at run time (the pool and the LMDB map are sized at start-up).

    Args:
        new: the ``host`` and ``disk`` settings after the change.
        changed: the keys being changed.
        host_pool: bytes of the host pool.
        disk_capacity: the disk tier's capacity, None when the disk tier is off.
        disk_map: bytes of the LMDB map.

    Raises:
        ValueError: a capacity grows past what the daemon started with.
    """
    host, disk = new
    if "host.capacity" in changed and host.capacity > host_pool:
        raise ValueError(f"host.capacity can only shrink at run time (pool is {host_pool} bytes; "
                         "restart to grow it)")
    if "disk.capacity" in changed and (disk_capacity is None or disk.capacity > disk_capacity
                                       and disk.capacity * 1.25 > disk_map):
        raise ValueError("disk.capacity cannot grow past the size the daemon started with")

"""Runtime tuning: apply changed settings (``tierkv tune``) to the running store, checking the rules of
:mod:`tierkv.cache.tuning` first so that a bad value changes nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierkv.cache import tuning
from tierkv.daemon.config import Config
from tierkv.daemon.startup import make_disk_policy, make_host_policy
from tierkv.tiers.disk import stored_size

if TYPE_CHECKING:
    from tierkv.cache.policy import Policy
    from tierkv.daemon.blockstore import BlockStore


def apply(st: BlockStore, new: Config, changed: set[str]) -> None:
    """Apply changed settings to the running tiers.

    Raises:
        ValueError: a value the running daemon cannot take (nothing changed).
    """
    disk = st.disk
    tuning.check_capacities(new, changed, st.host.capacity, disk.capacity if disk is not None else None,
                            disk.map_size if disk is not None else 0)
    host_policy = disk_policy = None
    if tuning.policy_changed("host", changed):
        host_policy = make_host_policy(new, st.history, st.host_reuse)
    if tuning.policy_changed("disk", changed):
        disk_policy = make_disk_policy(new, st.history, st.admission.evict_model)
    with st.lock:
        if host_policy is not None:
            _swap_host_policy(st, host_policy, new)
        if disk_policy is not None:
            _swap_disk_policy(st, disk_policy, new)
        st.set_config(new)
        st.admission.update(mode=new.disk.admission, shadow_rate=new.disk.shadow_rate)
        st.hostp.limit = min(st.host.capacity, new.host.capacity)
        if disk is not None:
            disk.capacity = new.disk.capacity
        st.engine.writes.codec = new.disk.codec
        st.engine.writes.level = new.disk.codec_level
        st.engine.budgets.set_rate("host<->disk", new.budget.host_disk or None)
        st.engine.budgets.set_rate("gpu<->host", new.budget.gpu_host or None)
        st.engine.budgets.set_rate("host<->remote", new.budget.host_remote or None)
    st.evictor.kick(force=st.host.used_bytes > new.host.high_watermark * st.hostp.limit)
    if disk is not None and st.diskp.used > new.disk.high_watermark * new.disk.capacity:
        st.transfers.trim_disk()  # the disk shrinks to its new size


def _swap_host_policy(st: BlockStore, policy: Policy, new: Config) -> None:
    """Same policy: new weights; another: it takes over every ready host block. Lock held."""
    if policy.name == st.hostp.policy.name:
        st.hostp.policy.update(**policy.settings())
        return
    for b in st.table.records():
        if b.host_off is not None and b.loading is None:
            policy.on_insert(b.fk, st.host.slot_size_at(b.host_off), b.parent)
    st.hostp.policy = policy


def _swap_disk_policy(st: BlockStore, policy: Policy, new: Config) -> None:
    """Same policy: new weights (and reuse factor); another: it takes over every block on disk. Lock held."""
    current = st.diskp.policy
    if policy.name == current.name:
        if hasattr(policy, "reuse") and hasattr(current, "reuse"):  # one class: both have it or neither
            current.reuse = policy.reuse
        current.update(**policy.settings())
        return
    for b in st.table.records():
        if b.on_disk:
            policy.on_insert(b.fk, stored_size(b.disk_bytes), b.parent)
    st.diskp.policy = policy

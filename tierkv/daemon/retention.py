"""Retention a client asks for: pinned prefixes (kept in host memory until unpinned, outliving the
connection) and windows (a live sequence fitted into a host budget, the rest demoted to disk)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierkv.cache.block import Block, Session
from tierkv.cache.windows import window_out
from tierkv.core.errors import BadRequest, TierFull

if TYPE_CHECKING:
    from tierkv.daemon.blockstore import BlockStore


def pin_prefix(st: BlockStore, s: Session, keys: list[bytes], priority: int) -> int:
    """Keep ``keys`` in the host tier (promoting from disk) until unpinned; returns blocks pinned.

    Pins outlive the connection (frozen system prompts); the pinned share of the host tier is
    capped by ``host.max_pinned_fraction``.
    """
    if not isinstance(priority, int) or not 1 <= priority <= 100:
        raise BadRequest("priority must be an int in 1..100")
    lease_id, _offs, _tiers = st.acquire(s, keys)

    def slot_bytes(b: Block) -> int:
        assert b.host_off is not None  # a host lease: every block is in a host slot
        return st.host.slot_size_at(b.host_off)
    with st.lock:
        lease, hp = s.leases[lease_id], st.hostp
        cap = st.cfg.host.max_pinned_fraction * hp.limit
        add = sum(slot_bytes(b) for b in lease.blocks if b.pin == 0)
        if hp.pinned_bytes + add > cap:
            st.release(s, [lease_id])
            raise TierFull(f"pinning {add} more bytes would exceed host.max_pinned_fraction "
                           f"({st.cfg.host.max_pinned_fraction:.0%} of the host tier)")
        for b in lease.blocks:
            if b.pin == 0:
                hp.pinned_bytes += slot_bytes(b)
            b.pin = max(b.pin, priority)
        st.release(s, [lease_id])
        return len(lease.blocks)


def unpin(st: BlockStore, s: Session, keys: list[bytes]) -> int:
    """Make pinned blocks evictable again; returns blocks unpinned."""
    st.ns(s)
    n = 0
    with st.lock:
        for k in keys:
            b = st.table.get(s.fp + k)
            if b is not None and b.pin:
                b.pin = 0
                if b.host_off is not None:
                    st.hostp.pinned_bytes -= st.host.slot_size_at(b.host_off)
                n += 1
        st.changed.notify_all()
    return n


def window(st: BlockStore, s: Session, keys: list[bytes], budget: int, sinks: int, recent: int) -> int:
    """Fit a live sequence into ``budget`` host blocks (:func:`tierkv.cache.windows.window_out`);
    the rest are demoted to disk, never dropped. Returns how many blocks were demoted."""
    st.ns(s)
    if min(budget, sinks, recent) < 0:
        raise BadRequest("budget, sinks and recent must be >= 0")
    with st.lock:
        out = window_out([st.table.get(s.fp + k) for k in keys], budget, sinks, recent)
        dirty = [b for b in out if not b.on_disk and st.disk is not None]
        for b in out:
            if b not in dirty:
                st.hostp.drop(b)
        st.changed.notify_all()
        job = st.transfers.store(dirty) if dirty else None
    if job is not None:
        job.wait()
        with st.lock:
            for b in dirty:
                if b.on_disk and b.host_off is not None and not b.protected:
                    st.hostp.drop(b)
            st.changed.notify_all()
    return len(out)

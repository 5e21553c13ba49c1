"""Snapshots of the store for ``tierkv stats``, ``/metrics`` and the sample ring: per tier capacity,
usage and counters, namespaces, and the transfer engine's links."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from tierkv.cache.counters import TierCounters
from tierkv.daemon.stats import tier_snapshot

if TYPE_CHECKING:
    from tierkv.daemon.blockstore import BlockStore


def store_snapshot(st: BlockStore) -> dict[str, Any]:
    """Leases, lookup index, health, tiers (hottest first), namespaces and transfers of ``st``."""
    with st.lock:
        tiers = _local_tiers(st)
        leases = sum(b.leases + b.gpu_leases for b in st.table.records())
    remote = remote_snapshot(st)  # may touch the network: outside the lock
    if remote is not None:
        tiers["remote"] = remote
    e = st.engine
    with st.lock:
        t = st.table
        namespaces = {ns.fingerprint.hex(): {"model": ns.model, "layout": ns.layout.to_dict(),
                                             "tp_rank": ns.tp_rank, "tp_size": ns.tp_size,
                                             "blocks": t.ns_blocks.get(fp, 0),
                                             "hits": t.ns_hits.get(fp, (0, 0))[0],
                                             "misses": t.ns_hits.get(fp, (0, 0))[1]}
                      for fp, ns in t.namespaces.items()}
        return {
            "leases": leases,
            # slots, keys, overflow (lookups answered by the daemon until it holds fewer blocks)
            "lookup_index": t.index.info() if t.index is not None else None,
            "health": "degraded" if st.degraded else "ok",
            "tiers": tiers,
            "namespaces": namespaces,
            "events": st.events.stats.to_dict() if st.events is not None else None,
            "transfer": {"inflight": e.book.inflight, "bytes": dict(e.book.link_bytes),
                         "seconds": {k: round(v, 4) for k, v in e.book.link_seconds.items()},
                         "links": {k: v.to_dict() for k, v in e.budgets.stats().items()},
                         "cost": st.cost.snapshot()},
        }


def _local_tiers(st: BlockStore) -> dict[str, dict]:
    """GPU, host and disk figures. Lock held."""
    host, hp = st.host, st.hostp
    records = list(st.table.records())
    host_blocks = [b for b in records if b.host_off is not None]
    live = sum(b.nbytes for b in host_blocks)
    tiers: dict[str, dict] = {}
    if st.gpu is not None:
        g = st.gpu
        assert st.gpup is not None  # attached with the GPU tier
        gpu_blocks = [b for b in records if b.gpu_off is not None]
        gpu_live = sum(b.nbytes for b in gpu_blocks)
        tiers["gpu"] = tier_snapshot(st.gpup.stats, capacity=g.capacity, used=g.used_bytes, blocks=len(gpu_blocks),
                                     kind=g.kind, device=g.device, fragmentation=round(g.fragmentation(gpu_live), 4),
                                     draining=sum(1 for b in gpu_blocks if b.draining),
                                     host_pinned=st.engine.host_pinned, policy=st.gpup.policy.name)
        tiers["gpu"]["bytes_logical"] = gpu_live
        tiers["gpu"]["bytes_stored"] = g.used_bytes
    tiers["host"] = tier_snapshot(hp.stats, capacity=host.capacity, used=host.used_bytes, blocks=len(host_blocks),
                                  fragmentation=round(host.fragmentation(live), 4),
                                  slabs={str(k): v for k, v in host.slab_usage().items()}, policy=hp.policy.name)
    tiers["host"].update(bytes_logical=live, bytes_stored=host.used_bytes, pinned_bytes=hp.pinned_bytes,
                         limit_bytes=hp.limit, reuse=st.host_reuse.snapshot())
    shadow = getattr(hp.policy, "shadow", None)
    if shadow is not None:
        tiers["host"]["shadow"] = shadow.snapshot()
    if st.disk is not None:
        dp, adm = st.diskp, st.admission
        tiers["disk"] = tier_snapshot(dp.stats, capacity=st.disk.capacity, used=dp.used,
                                      blocks=sum(1 for b in records if b.on_disk), codec=st.engine.writes.codec,
                                      file_bytes=st.disk.file_bytes(), readers=st.disk.readers(),
                                      policy=dp.policy.name, admission=st.cfg.disk.admission,
                                      admitted=adm.admitted, written_behind=hp.written_behind,
                                      rejected=adm.rejected, placement=adm.snapshot(),
                                      idle_half_life_s=round(getattr(dp.policy, "tau", 0.0), 1))
        shadow = getattr(dp.policy, "shadow", None)
        if shadow is not None:
            tiers["disk"]["shadow"] = shadow.snapshot()
    return tiers


def remote_snapshot(st: BlockStore) -> dict | None:
    """The remote tier's figures (server memory asked at most every 5 s)."""
    if st.remote is None:
        return None
    now = time.monotonic()
    if now - st.remote_info[0] > 5.0:
        st.remote_info = (now, st.remote.server_info())
    info = st.remote_info[1] or {}
    d = st.remote.stats()
    with st.lock:
        known = sum(1 for b in st.table.records() if b.on_remote)
    d.update({"capacity_bytes": info.get("max_bytes", 0), "used_bytes": info.get("used_bytes", 0),
              "blocks": known, "eviction_policy": info.get("policy", ""),
              "bytes_logical": st.remote_stats.bytes_in, "bytes_stored": d.get("bytes_in", 0)})
    return d


def tier_figures(st: BlockStore) -> list[tuple[str, TierCounters, int, int]]:
    """(tier, counters, used bytes, capacity) per tier, hottest first; plain reads, no lock, no walk."""
    out = []
    if st.gpu is not None:
        assert st.gpup is not None  # attached with the GPU tier
        out.append(("gpu", st.gpup.stats, st.gpu.used_bytes, st.gpu.capacity))
    out.append(("host", st.hostp.stats, st.host.used_bytes, st.host.capacity))
    if st.disk is not None:
        out.append(("disk", st.diskp.stats, st.diskp.used, st.disk.capacity))
    if st.remote is not None:
        info = st.remote_info[1] or {}
        out.append(("remote", st.remote_stats, info.get("used_bytes", 0), info.get("max_bytes", 0)))
    return out

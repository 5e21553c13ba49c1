"""Snapshots of the store for ``tierkv stats``, ``/metrics`` and the sample ring: per tier capacity,
usage and counters, namespaces, and the transfer engine's links."""

from __future__ import annotations

import time

from tierkv.cache.admission import Admission
from tierkv.cache.counters import TierCounters
from tierkv.cache.managers import TierManagers
from tierkv.cache.reuse import ReuseModel
from tierkv.daemon.context import Context
from tierkv.daemon.events import KvEvents
from tierkv.daemon.stats import tier_snapshot
from tierkv.daemon.tier_jobs import TierJobs


class Snapshots:
    """Reads the figures of every tier, the table and the transfer engine."""

    def __init__(self, ctx: Context, m: TierManagers, transfers: TierJobs, models: tuple[ReuseModel, Admission],
                 events: KvEvents | None) -> None:
        """The managers' figures, the tiers, engine and cost model (through the tier jobs), the reuse
        models' snapshots and the KV events' counters."""
        self.ctx = ctx
        self.m = m
        self.table = m.table
        self.tiers = transfers.tiers
        self.hostm = m.host
        self.diskm = m.disk
        self.gpum = m.gpu
        self.host_reuse, self.admission = models
        self.engine = transfers.engine
        self.cost = transfers.cost
        self.events = events
        self.remote_counters = m.remote.stats
        self.remote_info: tuple[float, dict | None] = (0.0, None)  # (when, remote server memory)

    def store(self) -> dict[str, object]:
        """Leases, lookup index, health, tiers (hottest first), namespaces and transfers."""
        with self.ctx.lock:
            tiers = self._local_tiers()
            leases = sum(b.leases + b.gpu_leases for b in self.table.records())
        remote = self.remote()  # may touch the network: outside the lock
        if remote is not None:
            tiers["remote"] = remote
        e = self.engine
        with self.ctx.lock:
            t = self.table
            namespaces = {ns.fingerprint.hex(): {"model": ns.model, "identity": ns.identity,
                                                 "layout": ns.layout.to_dict(),
                                                 "tp_rank": ns.tp_rank, "tp_size": ns.tp_size,
                                                 "blocks": t.ns_blocks.get(fp, 0),
                                                 "hits": t.ns_hits.get(fp, (0, 0))[0],
                                                 "misses": t.ns_hits.get(fp, (0, 0))[1]}
                          for fp, ns in t.namespaces.items()}
            return {
                "leases": leases,
                # slots, keys, overflow (lookups answered by the daemon until it holds fewer blocks)
                "lookup_index": t.index.info() if t.index is not None else None,
                "health": "degraded" if self.ctx.degraded else "ok",
                "tiers": tiers,
                "namespaces": namespaces,
                "events": self.events.stats.to_dict() if self.events is not None else None,
                "tenants": self.m.quotas.snapshot(),
                "transfer": {"inflight": e.book.inflight, "bytes": dict(e.book.link_bytes),
                             "seconds": {k: round(v, 4) for k, v in e.book.link_seconds.items()},
                             "links": {k: v.to_dict() for k, v in e.budgets.stats().items()},
                             "cost": self.cost.snapshot()},
            }

    def _local_tiers(self) -> dict[str, dict]:
        """GPU, host and disk figures. Lock held."""
        host, hp = self.tiers.host, self.hostm
        records = list(self.table.records())
        host_blocks = [b for b in records if b.host_off is not None]
        live = sum(b.nbytes for b in host_blocks)
        tiers: dict[str, dict] = {}
        if self.tiers.gpu is not None:
            g = self.tiers.gpu
            gpu_blocks = [b for b in records if b.gpu_off is not None]
            gpu_live = sum(b.nbytes for b in gpu_blocks)
            tiers["gpu"] = tier_snapshot(self.gpum.stats, capacity=g.capacity, used=g.used_bytes, blocks=len(gpu_blocks),
                                         kind=g.kind, device=g.device, fragmentation=round(g.fragmentation(gpu_live), 4),
                                         draining=sum(1 for b in gpu_blocks if b.draining),
                                         host_pinned=self.engine.host_pinned, policy=self.gpum.policy.name)
            tiers["gpu"]["bytes_logical"] = gpu_live
            tiers["gpu"]["bytes_stored"] = g.used_bytes
        tiers["host"] = tier_snapshot(hp.stats, capacity=host.capacity, used=host.used_bytes, blocks=len(host_blocks),
                                      fragmentation=round(host.fragmentation(live), 4),
                                      slabs={str(k): v for k, v in host.slab_usage().items()}, policy=hp.policy.name)
        tiers["host"].update(bytes_logical=live, bytes_stored=host.used_bytes, pinned_bytes=hp.pinned_bytes,
                             limit_bytes=hp.limit, reuse=self.host_reuse.snapshot())
        shadow = hp.policy.shadow
        if shadow is not None:
            tiers["host"]["shadow"] = shadow.snapshot()
        disk = self.tiers.disk
        if disk is not None:
            dp, adm, share = self.diskm, self.admission, self.engine.cpu_share
            tiers["disk"] = tier_snapshot(dp.stats, capacity=disk.capacity, used=dp.used,
                                          blocks=sum(1 for b in records if b.on_disk), codec=self.engine.writes.codec,
                                          file_bytes=disk.file_bytes(), readers=disk.readers(),
                                          policy=dp.policy.name, admission=self.ctx.cfg.disk.admission,
                                          admitted=adm.admitted, written_behind=self.m.outflow.written_behind,
                                          write_behind_waits=self.m.outflow.write_behind_waits,
                                          rejected=adm.rejected, placement=adm.snapshot(),
                                          background_cpu_s=round(share.used_s, 3) if share else 0.0,
                                          background_waited_s=round(share.waited_s, 3) if share else 0.0,
                                          idle_half_life_s=round(dp.policy.tau, 1))
            shadow = dp.policy.shadow
            if shadow is not None:
                tiers["disk"]["shadow"] = shadow.snapshot()
        return tiers

    def health(self) -> str:
        """Why the store is degraded ("" when healthy): its own reason, or the remote tier's state."""
        remote = self.tiers.remote
        state = remote.state()["state"] if remote is not None else "up"
        return self.ctx.degraded or ("" if state == "up" else f"remote tier {state}")

    def remote(self) -> dict | None:
        """The remote tier's figures (server memory asked at most every 5 s)."""
        remote = self.tiers.remote
        if remote is None:
            return None
        now = time.monotonic()
        if now - self.remote_info[0] > 5.0:
            self.remote_info = (now, remote.server_info())
        info = self.remote_info[1] or {}
        d = remote.stats()
        with self.ctx.lock:
            known = sum(1 for b in self.table.records() if b.on_remote)
        d.update({"capacity_bytes": info.get("max_bytes", 0), "used_bytes": info.get("used_bytes", 0),
                  "blocks": known, "eviction_policy": info.get("policy", ""),
                  "bytes_logical": self.remote_counters.bytes_in, "bytes_stored": d.get("bytes_in", 0)})
        return d

    def tier_figures(self) -> list[tuple[str, TierCounters, int, int]]:
        """(tier, counters, used bytes, capacity) per tier, hottest first; plain reads, no lock, no walk."""
        t = self.tiers
        out = []
        if t.gpu is not None:
            out.append(("gpu", self.gpum.stats, t.gpu.used_bytes, t.gpu.capacity))
        out.append(("host", self.hostm.stats, t.host.used_bytes, t.host.capacity))
        if t.disk is not None:
            out.append(("disk", self.diskm.stats, self.diskm.used, t.disk.capacity))
        if t.remote is not None:
            info = self.remote_info[1] or {}
            out.append(("remote", self.remote_counters, info.get("used_bytes", 0), info.get("max_bytes", 0)))
        return out

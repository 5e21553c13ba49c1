"""Retention a client or the operator asks for: pins (in host memory or on disk until unpinned, outliving
the connection and, with a disk tier, the daemon: :mod:`tierkv.daemon.pins`), windows (a live sequence
fitted into a host budget, the rest demoted to disk) and deletes."""

from __future__ import annotations

import logging
import sys
import time

from tierkv.cache.block import Block, Session
from tierkv.cache.managers import TierManagers
from tierkv.cache.windows import window_out
from tierkv.core.errors import BadRequest, TierFull
from tierkv.core.keys import FINGERPRINT_BYTES
from tierkv.daemon import pins
from tierkv.daemon.context import Context
from tierkv.daemon.fetchpath import FetchPath
from tierkv.daemon.sessions import namespace
from tierkv.daemon.tier_jobs import TierJobs

log = logging.getLogger("tierkv.daemon.pins")


class Retention:
    """Pins, windows and deletes."""

    def __init__(self, ctx: Context, m: TierManagers, transfers: TierJobs, fetch: FetchPath,
                 pins_dir: str | None) -> None:
        """The managers it sequences, the tier jobs it starts (writes and deletes on disk), the fetch
        path a pin leases its prefix through, and the folder pins are kept in across restarts (None:
        not kept: no disk tier)."""
        self.ctx, self.m, self.table, self.hostm = ctx, m, m.table, m.host
        self.host, self.disk, self.transfers = transfers.host, transfers.disk, transfers
        self.fetch, self.pins_dir = fetch, pins_dir

    def pin_prefix(self, s: Session, keys: list[bytes], priority: int, tier: str = "host", count: int = 1) -> int:
        """Keep ``keys`` in ``tier`` (``host``: in host memory, promoting from disk; ``disk``: on disk,
        writing what host memory holds only) until unpinned as many times as pinned (``count`` pins at
        once); returns blocks pinned: the leading run of ``keys`` cached.

        Pins outlive the connection (frozen system prompts); the pinned share of each tier is capped by
        its ``max_pinned_fraction`` (``TierFull`` with the bytes the pin needs).
        """
        if not isinstance(priority, int) or not 1 <= priority <= 100:
            raise BadRequest("priority must be an int in 1..100")
        if tier == "disk":
            return self._pin_on_disk(s, keys, count)
        if tier != "host":
            raise BadRequest(f"a pin keeps blocks in host memory or on disk: tier must be host or disk, not {tier!r}")
        lease_id, _offs, _tiers = self.fetch.acquire(s, namespace(s), keys)

        def slot_bytes(b: Block) -> int:
            assert b.host_off is not None  # a host lease: every block is in a host slot
            return self.host.slot_size_at(b.host_off)
        with self.ctx.lock:
            lease, hp, cfg = s.leases[lease_id], self.hostm, self.ctx.cfg
            cap = cfg.host.max_pinned_fraction * hp.limit
            add = sum(slot_bytes(b) for b in lease.blocks if b.pin == 0)
            if hp.pinned_bytes + add > cap:
                self._release(s, lease_id)
                raise TierFull(f"pinning {add} more bytes would exceed host.max_pinned_fraction "
                               f"({cfg.host.max_pinned_fraction:.0%} of the host tier, {int(cap)} bytes; "
                               f"{hp.pinned_bytes} pinned)")
            for b in lease.blocks:
                hp.pin(b, priority, count)
            self._release(s, lease_id)
            self.keep([b for b in lease.blocks if not b.on_disk])
            return len(lease.blocks)

    def _pin_on_disk(self, s: Session, keys: list[bytes], count: int) -> int:
        """Pin the leading run of ``keys`` on disk or in host memory on disk, writing those not there yet
        (and waiting for the write); a block the write could not place ends the run."""
        if self.disk is None:
            raise BadRequest("a pin on disk needs a disk tier")
        namespace(s)
        diskm, cfg = self.m.disk, self.ctx.cfg
        with self.ctx.lock:
            run: list[Block] = []
            for k in keys:
                b = self.table.get(s.fp + k)
                if b is None or not (b.on_disk or b.host_ready):
                    break
                run.append(b)
            cap = cfg.disk.max_pinned_fraction * diskm.capacity()
            add = sum(b.nbytes for b in run if b.disk_pins == 0)
            if diskm.pinned_bytes + add > cap:
                raise TierFull(f"pinning {add} more bytes on disk would exceed disk.max_pinned_fraction "
                               f"({cfg.disk.max_pinned_fraction:.0%} of the disk tier, {int(cap)} bytes; "
                               f"{diskm.pinned_bytes} pinned)")
            for b in run:
                diskm.pin(b, count)
            dirty = [b for b in run if not b.on_disk and not b.writing]
            job = self.transfers.store(dirty) if dirty else None
        if job is not None:
            job.wait()
        with self.ctx.lock:
            deadline = time.monotonic() + cfg.server.commit_wait_s  # another write of the block ends soon
            while any(b.writing and not b.on_disk for b in run) and self.ctx.wait_until(deadline):
                pass
            placed = next((i for i, b in enumerate(run) if not b.on_disk), len(run))
            for b in run[placed:]:  # the write failed (a disk full of blocks that must stay)
                for _ in range(count):
                    diskm.unpin(b)
            self.keep()
        if placed < len(run) and job is not None and job.error is not None:
            raise TierFull(f"the disk tier took {placed} of the {len(run)} blocks: {job.error}")
        return placed

    def keep(self, dirty: list[Block] | None = None) -> None:
        """Pins or quotas changed: keep them for the next start, and write ``dirty`` pinned blocks to disk
        (a write nothing preempts: a block left unwritten is not pinned again after a restart). Lock held."""
        if self.pins_dir is None:
            return
        pins.save(self.table, self.m.quotas, self.pins_dir)
        if dirty:
            self.transfers.store(dirty)

    def at_stop(self, timeout: float) -> bool:
        """At a graceful stop: write the pinned blocks not on disk yet (a write refused earlier), waiting
        up to ``timeout`` seconds, the pins, quotas and namespaces, and which tenant with a quota owns each
        block on disk. True when no
        pinned block is left unwritten."""
        if self.pins_dir is None or self.disk is None:
            return True
        with self.ctx.lock:
            dirty = [b for b in self.table.records() if b.pin and not b.on_disk and not b.writing and b.host_ready]
            job = self.transfers.store(dirty) if dirty else None
        if job is not None:
            job.wait(timeout)
        with self.ctx.lock:
            pins.save(self.table, self.m.quotas, self.pins_dir)
            pins.save_tenants(self.table, self.m.quotas, self.pins_dir)
            left = sum(1 for b in self.table.records() if b.pin and not b.on_disk)
        if left:
            log.warning("pins: %d pinned blocks are not on disk and will not be pinned at the next start", left)
        return not left

    def restore(self) -> int:
        """Pin again what the previous run kept pinned and is still on disk (host pins loaded into host
        memory), as many times, under its namespaces, registered now; returns blocks pinned. At
        start-up, before any request."""
        if self.pins_dir is None:
            return 0
        spaces, kept, quotas = pins.load(self.pins_dir)
        owners = pins.load_tenants(self.pins_dir)
        with self.ctx.lock:
            for fk, tenant in owners.items():
                b = self.table.get(fk)
                if b is not None and b.tenant is None:
                    b.tenant = sys.intern(tenant)
            for tenant, limits in quotas.items():
                try:
                    self.m.set_quota(tenant, limits)
                except ValueError as exc:
                    log.warning("quota of %r not restored: %s", tenant, exc)
        n = 0
        for i, pin in enumerate(kept):
            ns = spaces.get(pin.fk[:FINGERPRINT_BYTES])
            if ns is None or pin.fk not in self.table:
                continue
            s = Session(-1 - i)
            with self.ctx.lock:
                self.table.bind(s, ns)
            try:
                key = [pin.fk[FINGERPRINT_BYTES:]]
                if pin.disk:
                    n += self.pin_prefix(s, key, 1, tier="disk", count=pin.disk)
                if pin.host:
                    n += self.pin_prefix(s, key, pin.priority, count=pin.host)
            except TierFull as exc:
                log.warning("pins: %d of %d restored: %s", n, len(kept), exc)
                break
            finally:
                with self.ctx.lock:
                    self.m.end_leases(self.table.drop_leases(s))
                    self.table.unbind(s)
        with self.ctx.lock:
            for fp, ns in spaces.items():  # the control API names them before an engine connects
                self.table.namespaces.setdefault(fp, ns)
        return n

    def _release(self, s: Session, lease_id: int) -> None:
        self.m.end_leases(self.table.release(s, [lease_id]))
        self.ctx.notify()

    def unpin(self, s: Session, keys: list[bytes], tier: str = "host") -> int:
        """End one pin in ``tier`` (``host`` or ``disk``) of each block; returns blocks whose pin ended
        (a block pinned twice stays pinned until unpinned twice)."""
        namespace(s)
        if tier not in ("host", "disk"):
            raise BadRequest(f"tier must be host or disk, not {tier!r}")
        n = 0
        with self.ctx.lock:
            for k in keys:
                b = self.table.get(s.fp + k)
                if b is not None and (self.hostm.unpin(b) if tier == "host" else self.m.disk.unpin(b)):
                    n += 1
            if n:
                self.keep()
            self.ctx.notify()
        return n

    def window(self, s: Session, keys: list[bytes], budget: int, sinks: int, recent: int) -> int:
        """Fit a live sequence into ``budget`` host blocks (:func:`tierkv.cache.windows.window_out`);
        the rest are demoted to disk, never dropped. Returns how many blocks were demoted."""
        namespace(s)
        if min(budget, sinks, recent) < 0:
            raise BadRequest("budget, sinks and recent must be >= 0")
        ctx, hp = self.ctx, self.hostm
        with ctx.lock:
            out = window_out([self.table.get(s.fp + k) for k in keys], budget, sinks, recent)
            dirty = [b for b in out if not b.on_disk and self.disk is not None]
            for b in out:
                if b not in dirty:
                    hp.drop(b)
            ctx.notify()
            job = self.transfers.store(dirty) if dirty else None
        if job is not None:
            job.wait()
            with ctx.lock:
                for b in dirty:
                    if b.on_disk and b.host_off is not None and not b.protected:
                        hp.drop(b)
                ctx.notify()
        return len(out)

    def delete(self, s: Session, keys: list[bytes]) -> int:
        """Drop blocks from every tier (leased or in-flight ones are skipped); returns blocks dropped."""
        namespace(s)
        gone: list[bytes] = []
        with self.ctx.lock:
            for k in keys:
                b = self.table.get(s.fp + k)
                if b is None or b.busy:
                    continue
                if self.m.delete(b):
                    gone.append(b.fk)
            self.ctx.notify()
        if gone and self.disk is not None:
            self.disk.delete(gone)
        return len(keys) - sum(1 for k in keys if (s.fp + k) in self.table)

    def drop(self, s: Session, keys: list[bytes] | None, tiers: frozenset[str], force: bool) -> int:
        """The operator's delete: the copies in ``tiers`` (of ``gpu``, ``host``, ``disk``, ``remote``: the
        remote copies this daemon knows of) of ``keys``' blocks, or with ``keys`` None of every block of
        the connection's namespace. Pinned blocks only with ``force`` (unpinned first); blocks in use stay.
        Returns the blocks that lost a copy."""
        namespace(s)
        with self.ctx.lock:
            blocks = ([b for k in keys if (b := self.table.get(s.fp + k)) is not None] if keys is not None
                      else [b for b in self.table.records() if b.fk.startswith(s.fp)])
        return self._drop(blocks, tiers, force)

    def drop_tenant(self, tenant: str, fingerprints: set[bytes] | None, tiers: frozenset[str], force: bool) -> int:
        """:meth:`drop` of every block ``tenant`` stored (the vLLM connector's ``cache_salt``), in the
        namespaces of ``fingerprints`` (None: in all)."""
        with self.ctx.lock:
            blocks = [b for b in self.table.records() if b.tenant == tenant
                      and (fingerprints is None or b.fk[:FINGERPRINT_BYTES] in fingerprints)]
        return self._drop(blocks, tiers, force)

    def _drop(self, blocks: list[Block], tiers: frozenset[str], force: bool) -> int:
        gone: list[bytes] = []
        remote: list[tuple[bytes, bytes]] = []
        n = 0
        with self.ctx.lock:
            blocks = [b for b in blocks if b.fk in self.table]
            unpinned = False
            for b in blocks:
                if force:
                    unpinned = self.hostm.unpin(b, every=True) or unpinned
                    unpinned = self.m.disk.unpin(b, every=True) or unpinned
            # a write out of a block's slot (write-behind, a pin made durable) ends soon: wait for it
            deadline = time.monotonic() + self.ctx.cfg.server.commit_wait_s
            while any(b.writing and b.fk in self.table for b in blocks) and self.ctx.wait_until(deadline):
                pass
            for b in blocks:
                if b.busy or b.disk_pins or b.fk not in self.table:
                    continue
                held = set(b.held())
                if "remote" in tiers and b.on_remote:
                    remote.append((b.fk[:FINGERPRINT_BYTES], b.fk[FINGERPRINT_BYTES:]))
                    self.m.remote.deleted(b)
                if self.m.delete(b, tiers):
                    gone.append(b.fk)
                n += bool(held - set(b.held()) or b.fk not in self.table)
            if unpinned:
                self.keep()
            self.ctx.notify()
        if gone and self.disk is not None:
            self.disk.delete(gone)
        if remote and self.transfers.remote is not None:
            self.transfers.remote.delete_many(remote)
        return n

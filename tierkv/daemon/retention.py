"""Retention a client asks for: pinned prefixes (kept in host memory until unpinned, outliving the
connection and, with a disk tier, the daemon: :mod:`tierkv.daemon.pins`), windows (a live sequence fitted into a host budget, the rest demoted to disk) and
deletes (blocks dropped from every tier)."""

from __future__ import annotations

import logging
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
        self.ctx = ctx
        self.m = m
        self.table = m.table
        self.host = transfers.host
        self.hostm = m.host
        self.disk = transfers.disk
        self.transfers = transfers
        self.fetch = fetch
        self.pins_dir = pins_dir

    def pin_prefix(self, s: Session, keys: list[bytes], priority: int) -> int:
        """Keep ``keys`` in the host tier (promoting from disk) until unpinned; returns blocks pinned.

        Pins outlive the connection (frozen system prompts); the pinned share of the host tier is
        capped by ``host.max_pinned_fraction``.
        """
        if not isinstance(priority, int) or not 1 <= priority <= 100:
            raise BadRequest("priority must be an int in 1..100")
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
                               f"({cfg.host.max_pinned_fraction:.0%} of the host tier)")
            for b in lease.blocks:
                hp.pin(b, priority)
            self._release(s, lease_id)
            self._keep_pins([b for b in lease.blocks if not b.on_disk])
            return len(lease.blocks)

    def _keep_pins(self, dirty: list[Block] | None = None) -> None:
        """Pins changed: keep them for the next start, and write the pinned blocks not on disk yet there
        (a write no other gives way to: nobody waits for it, but a block left unwritten would not be
        pinned again after a restart). Lock held."""
        if self.pins_dir is None:
            return
        pins.save(self.table, self.pins_dir)
        if dirty:
            self.transfers.store(dirty)

    def flush_pins(self, timeout: float) -> bool:
        """Write the pinned blocks not on disk yet (a write refused or failed earlier) and wait up to
        ``timeout`` seconds; at shutdown, so the next start pins all of them again. True when none is
        left unwritten."""
        if self.pins_dir is None or self.disk is None:
            return True
        with self.ctx.lock:
            dirty = [b for b in self.table.records()
                     if b.pin and not b.on_disk and not b.writing and b.host_off is not None]
            job = self.transfers.store(dirty) if dirty else None
        if job is not None:
            job.wait(timeout)
        with self.ctx.lock:
            left = sum(1 for b in self.table.records() if b.pin and not b.on_disk)
        if left:
            log.warning("pins: %d pinned blocks are not on disk and will not be pinned at the next start", left)
        return not left

    def restore(self) -> int:
        """Pin again what the previous run kept pinned and is still on disk (loaded into host memory),
        under its namespaces, registered now; returns blocks pinned. At start-up, before any request."""
        if self.pins_dir is None:
            return 0
        spaces, kept = pins.load(self.pins_dir)
        n = 0
        for i, (fk, priority) in enumerate(kept):
            ns = spaces.get(fk[:FINGERPRINT_BYTES])
            if ns is None or fk not in self.table:
                continue
            s = Session(-1 - i)
            with self.ctx.lock:
                self.table.bind(s, ns)
            try:
                n += self.pin_prefix(s, [fk[FINGERPRINT_BYTES:]], priority)
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

    def unpin(self, s: Session, keys: list[bytes]) -> int:
        """Make pinned blocks evictable again; returns blocks unpinned."""
        namespace(s)
        n = 0
        with self.ctx.lock:
            for k in keys:
                b = self.table.get(s.fp + k)
                if b is not None and self.hostm.unpin(b):
                    n += 1
            if n:
                self._keep_pins()
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
        ns = namespace(s)
        gone: list[bytes] = []
        remote: list[tuple[bytes, bytes]] = []
        n = 0
        with self.ctx.lock:
            blocks = ([b for k in keys if (b := self.table.get(s.fp + k)) is not None] if keys is not None
                      else [b for b in self.table.records() if b.fk.startswith(s.fp)])
            unpinned = False
            for b in blocks:
                if force:
                    unpinned = self.hostm.unpin(b) or unpinned
            # a write out of a block's slot (write-behind, a pin made durable) ends soon: wait for it
            deadline = time.monotonic() + self.ctx.cfg.server.commit_wait_s
            while any(b.writing and b.fk in self.table for b in blocks) and self.ctx.wait_until(deadline):
                pass
            for b in blocks:
                if b.busy or b.fk not in self.table:
                    continue
                held = set(b.held())
                if "remote" in tiers and b.on_remote:
                    remote.append((ns.fingerprint, b.fk[len(s.fp):]))
                    self.m.remote.deleted(b)
                if self.m.delete(b, tiers):
                    gone.append(b.fk)
                n += bool(held - set(b.held()) or b.fk not in self.table)
            if unpinned:
                self._keep_pins()
            self.ctx.notify()
        if gone and self.disk is not None:
            self.disk.delete(gone)
        if remote and self.transfers.remote is not None:
            self.transfers.remote.delete_many(remote)
        return n

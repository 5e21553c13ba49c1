"""The store path: ``alloc`` hands a connection host slots, the client writes them, ``commit`` publishes
them under their keys (a key already cached is deduplicated); durable commits wait for (or queue) the
disk write, remote commits for the write-through of every committed block to the remote tier. The GPU
tier's slots and commits are :mod:`tierkv.daemon.gpupath`'s."""

from __future__ import annotations

import time

from tierkv.cache.block import Block, Session
from tierkv.cache.managers import TierManagers
from tierkv.core.errors import BadRequest, TierKVError
from tierkv.core.keys import Namespace
from tierkv.daemon.commits import check_alloc, check_commit, check_slots, finish, job_failed
from tierkv.daemon.context import Context
from tierkv.daemon.signals import Signals
from tierkv.daemon.slots import Slots
from tierkv.daemon.tier_jobs import TierJobs
from tierkv.tiers.host import slot_size_for


class StorePath:
    """Slots out, commits in."""

    def __init__(self, ctx: Context, m: TierManagers, slots: Slots, transfers: TierJobs, signals: Signals) -> None:
        """The managers it sequences, the slots it hands out, the tier jobs it starts (disk and remote
        writes) and the signals a commit feeds."""
        self.ctx = ctx
        self.m = m
        self.table = m.table
        self.host = transfers.host
        self.hostm = m.host
        self.slots = slots
        self.transfers = transfers
        self.signals = signals
        self.disk_on = m.disk.present

    # ---- alloc ------------------------------------------------------------------------------------
    def alloc(self, s: Session, ns: Namespace, n: int, keys: list[bytes] | None, timeout: float | None = None,
              keep: list[bytes] | None = None) -> list[int | None]:
        """Slots for ``n`` new blocks (None where ``keys[i]`` is already cached: nothing to write); a
        full host tier drops blocks rather than wait for the disk writer, and waits at most ``timeout``
        seconds for blocks in use. The host blocks of ``keep`` (cached blocks the new ones continue,
        which the store skips) are held as leased while room is made: none of them is evicted for it."""
        check_alloc(n, keys)
        slot = slot_size_for(ns.layout.block_bytes)
        hp = self.hostm
        if n * slot > hp.limit:
            raise BadRequest(f"{n} blocks of {slot} bytes exceed the host tier ({hp.limit} bytes)")
        with self.ctx.lock:
            held = [b for k in keep or () if (b := self.table.get(s.fp + k)) is not None and b.host_off is not None]
            for b in held:
                hp.lease(b)
            try:
                new = n if keys is None else sum(1 for k in keys if (s.fp + k) not in self.table)
                if hp.make_room(new * slot):
                    self.ctx.notify()
                return self.slots.take(s, keys, n, slot, lambda: self.slots.host(slot, timeout=timeout), s.slots,
                                       self.host.free)
            finally:
                for b in held:
                    hp.unlease(b)
                if held:
                    self.ctx.notify()  # a request waiting for an evictable block may take one of these

    # ---- commit -----------------------------------------------------------------------------------
    def commit(self, s: Session, ns: Namespace, keys: list[bytes], offsets: list[int], durable: bool,
               wait: bool, chains: dict[int, bytes | None] | None, remote: bool,
               tokens: list[bytes] | None, uses: list[bytes] | None = None,
               tenants: dict[int, str | None] | None = None) -> int:
        """Publish written host slots under ``keys``; returns how many were new (the rest
        deduplicated). ``keys`` are prefix chains, each key the child of the one before except at the
        indexes of ``chains``, where a chain continues the key given (None: starts one; default
        ``{0: None}``). ``durable`` with ``wait=False`` (host tier): return once the disk write is
        queued; :meth:`sync` waits for it (a client streams a large durable put: its next copy overlaps
        this write). ``remote``: every block is written through, admitted or not, before the return
        (if writable). ``tokens``: each block's token ids (int32), kept for KV events when they are on.
        ``uses``: cached blocks the client skipped rather than write again; each still cached counts as
        a use, as a deduplicated block does, before the new blocks are published. ``tenants``: where runs
        of new blocks of one tenant start (index: tenant), whose quotas count them."""
        check_commit(keys, offsets, durable, self.disk_on)
        return self._commit_host(s, ns, keys, offsets, durable, wait, chains or {0: None}, remote, tokens, uses,
                                 tenants or {})

    def _use(self, s: Session, uses: list[bytes] | None) -> list[Block]:
        """Count a use of each cached block of ``uses`` (one gone since is a later miss); returns the
        blocks found. Lock held."""
        found = [b for k in uses or () if (b := self.table.get(s.fp + k)) is not None]
        for b in found:
            self.hostm.touch(b)
        return found

    def _commit_host(self, s: Session, ns: Namespace, keys: list[bytes], offsets: list[int], durable: bool,
                     wait: bool, chains: dict[int, bytes | None], remote: bool,
                     tokens: list[bytes] | None, uses: list[bytes] | None, tenants: dict[int, str | None]) -> int:
        """Publish written host slots under ``keys``, prefix chains starting at the indexes of ``chains``."""
        fks = [s.fp + k for k in keys]
        remote = remote and self.transfers.remote_writable()
        with self.ctx.lock:
            check_slots(offsets, s.slots, "slot")
            used = self._use(s, uses)
            starts = {i: None if p is None else s.fp + p for i, p in chains.items()}
            new, committed = self._publish_host(s, ns, fks, offsets, starts, tokens, tenants)
            self.signals.computed(new)
            # the producer side of PD across nodes: the prefix its blocks continue, and the cached blocks
            # it skipped, go to the remote too (each block once)
            through = self.transfers.write_through(
                list({b.fk: b for b in committed + used + self._ancestors(starts)}.values()) if remote else new,
                every=remote)
            self.signals.stored(fks, starts)
            durable_blocks = [b for b in committed if not b.on_disk] if durable else []
            job = self.transfers.store(durable_blocks) if durable_blocks else None
            if job is not None and not wait:
                s.pending.append(job)
                job = None
            self.ctx.notify()
        finish(self.ctx, job, through)
        self.ctx.kick()
        if self.ctx.synchronous:  # one trace, one result: the evictor's pass ends before the commit returns
            with self.ctx.lock:
                self.ctx.wait_for_pass(time.monotonic() + self.ctx.cfg.server.slot_wait_s)
        return len(new)

    def _publish_host(self, s: Session, ns: Namespace, fks: list[bytes], offsets: list[int],
                      starts: dict[int, bytes | None], tokens: list[bytes] | None,
                      tenants: dict[int, str | None]) -> tuple[list[Block], list[Block]]:
        """Records for committed host slots, chains starting at ``starts`` (index: parent): (new
        blocks, every committed block). Lock held."""
        table, hp = self.table, self.hostm
        new: list[Block] = []
        committed: list[Block] = []
        parent: bytes | None = None
        tenant: str | None = None
        for i, (fk, off) in enumerate(zip(fks, offsets)):
            if i in starts:
                parent = starts[i]
            tenant = tenants.get(i, tenant)
            del s.slots[off]
            b = table.get(fk)
            if b is None:
                b = table.add(Block(fk, ns.layout.block_bytes, parent, tokens[i] if tokens else None, tenant))
                hp.committed(b, off, parent)
                new.append(b)
            elif b.host_off is None and b.loading is None:
                hp.kept(b, off, parent, tokens[i] if tokens else None)  # on disk only: no read back
            else:
                self.host.free(off)  # deduplicated
                hp.touch(b)
            committed.append(b)
            parent = fk
        return new, committed

    def _ancestors(self, starts: dict[int, bytes | None], limit: int = 1 << 14) -> list[Block]:
        """The blocks the chains of a commit continue (parents' parents, up to ``limit``) that are not
        on the remote tier: a prefix the engine loaded rather than computed. Lock held."""
        out: list[Block] = []
        for parent in starts.values():
            b = self.table.get(parent) if parent is not None else None
            while b is not None and not b.on_remote and len(out) < limit:
                out.append(b)
                b = self.table.get(b.parent) if b.parent is not None else None
        return out

    # ---- sync and abort ---------------------------------------------------------------------------
    def sync(self, s: Session) -> None:
        """Wait for the durable writes this connection committed with ``wait=False``.

        Raises:
            TierKVError: one of them failed (the first error); every one was waited for.
        """
        with self.ctx.lock:
            jobs, s.pending = s.pending, []
        failed: TierKVError | None = None
        for job in jobs:
            job.wait()
            if failed is None:
                failed = job_failed(job)
        if failed is not None:
            raise failed

    def abort(self, s: Session, offsets: list[int]) -> None:
        """Give back allocated host slots without committing them."""
        with self.ctx.lock:
            for off in offsets:
                if off in s.slots:
                    del s.slots[off]
                    self.host.free(off)
            self.ctx.notify()

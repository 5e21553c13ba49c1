"""The load path: ``lookup`` says how much of a prefix is cached and where, ``fetch`` leases it
(promoting cold blocks in the background) and returns a ticket, ``wait`` turns the ticket into a lease
on what arrived in time; ``prefetch`` only warms blocks and ``plan`` weighs fetching against recompute."""

from __future__ import annotations

import itertools
import time

from tierkv.cache.block import Block, Session, fetch_source, tier_of
from tierkv.cache.costmodel import CostModel, Run
from tierkv.cache.managers import TierManagers
from tierkv.core.errors import BadRequest, TierFull
from tierkv.core.keys import Namespace, chain_keys
from tierkv.core.prefix import tier_tokens
from tierkv.daemon.context import Context
from tierkv.daemon.slots import Slots
from tierkv.daemon.tier_jobs import TierJobs
from tierkv.tiers.host import slot_size_for


class FetchPath:
    """Lookups, fetches into host (or GPU) memory, waits, prefetches and plans."""

    def __init__(self, ctx: Context, m: TierManagers, slots: Slots, transfers: TierJobs) -> None:
        """The managers it sequences, the slots it takes, and the tier jobs it starts (loads, copies down
        from the GPU, the remote tier's lookups; the cost model a plan reads)."""
        self.ctx = ctx
        self.m = m
        self.table = m.table
        self.host = transfers.host
        self.hostm = m.host
        self.slots = slots
        self.transfers = transfers
        self.cost: CostModel = transfers.cost
        self.remote = transfers.remote
        self._warm: dict[bytes, tuple[Block, int]] = {}  # prefetched, not used since: (block, its hits then)

    def lookup(self, fp: bytes, keys: list[bytes]) -> list[str]:
        """Tier of each leading cached block of namespace ``fp``; stops at the first miss."""
        with self.ctx.lock:
            out = self.table.lookup(fp, keys)
        if self.remote is not None and len(out) < len(keys):
            # Only the part of the prefix no local tier holds, in one round trip (outside the lock).
            out += ["remote"] * self.remote.prefix_len(fp, keys[len(out):])
        return out

    def lookup_tokens(self, model: str, tp_rank: int, tokens: list[int], identity: str | None = None) -> dict:
        """For a router: the leading tokens of prompt ``tokens`` each tier holds
        (:func:`~tierkv.core.prefix.tier_tokens`), keyed in the namespace a connected engine of ``model``
        registered at ``tp_rank`` (with ``identity``, or a prefix of it, where engines of several
        identities serve that model id).

        Raises:
            BadRequest: no connected engine of that model at that rank, or several and no identity to choose.
        """
        with self.ctx.lock:
            found = {n.identity: n for n in self.table.namespaces.values() if n.model == model
                     and n.tp_rank == tp_rank and (not identity or n.identity.startswith(identity))}
        if not found:
            raise BadRequest(f"no connected engine serves model {model!r} at TP rank {tp_rank}"
                             + (f" with identity {identity}" if identity else ""))
        if len(found) > 1:
            raise BadRequest(f"model {model!r} is served under {len(found)} identities "
                             f"({', '.join(sorted(i[:16] for i in found))}): name one")
        ns = next(iter(found.values()))
        bt = ns.layout.block_tokens
        keys = chain_keys(ns.fingerprint, tokens, bt)
        return tier_tokens(self.lookup(ns.fingerprint, keys) if keys else [], bt, len(tokens))

    def lookup_count(self, s: Session, keys: list[bytes]) -> int:
        """How many leading blocks are cached, without naming the tiers (the scheduler's hot path)."""
        with self.ctx.lock:
            n = self.table.lookup_count(s.fp, keys)
        if n < len(keys) and self.remote is not None:
            n += self.remote.prefix_len(s.fp, keys[n:])  # outside the lock, as in lookup
        return n

    # ---- fetch ------------------------------------------------------------------------------------
    def fetch(self, s: Session, ns: Namespace, keys: list[bytes]) -> int:
        """Start leasing the cached prefix of ``keys`` in host memory (host blocks at once, colder ones as
        they arrive); returns a ticket for :meth:`wait`. Never blocks on the disk."""
        slot = slot_size_for(ns.layout.block_bytes)
        leased: list[Block] = []
        tiers: list[str] = []
        loads: list[Block] = []
        with self.ctx.lock:
            for k in keys:
                b = self.table.get(s.fp + k)
                if b is None:
                    self.hostm.missed()
                    break
                source = self._lease_source(b, slot, loads)
                if source is None:
                    break
                tiers.append(source)
                self.hostm.lease(b)
                self.hostm.touch(b)
                leased.append(b)
            if loads:
                self.transfers.load(ns, loads)
            self.transfers.write_through([b for b in leased if b.loading is None])
        if self.remote is not None and len(leased) < len(keys):
            self._fetch_remote(s, ns, keys[len(leased):], slot, leased, tiers)
        with self.ctx.lock:
            self.table.count_fetch(s.fp, len(keys), len(leased))
            return self.table.open_ticket(s, leased, tiers, "host")

    def _lease_source(self, b: Block, slot: int, loads: list[Block]) -> str | None:
        """The tier a host lease on ``b`` is served from, starting its load when it has no host slot;
        None: it cannot be leased at this point (the prefix ends). Lock held."""
        hp = self.hostm
        if b.host_off is not None:
            hp.served(b)
            return fetch_source(b)
        if b.on_disk:
            off = self._slot_for(b, slot)
            if off is None or b.host_off is not None or not b.on_disk:
                return self._moved(b, off, slot, loads)
            self.transfers.prepare_load(b, off)
            loads.append(b)
            hp.missed()
            return "disk"
        if b.gpu_off is not None and b.gpu_loading is None:
            # only on the GPU: its host copy was dropped unwritten, or its drain found no host slot and
            # waits for a retry; a lease may wait for room, so it copies the block down now
            off = self._slot_for(b, slot)
            if off is None or b.host_off is not None or b.gpu_off is None or b.gpu_loading is not None:
                return self._moved(b, off, slot, loads)
            self.transfers.copy_down(b, off)
            hp.missed()
            return "gpu"
        return None

    def _slot_for(self, b: Block, slot: int) -> int | None:
        """A host slot to promote ``b`` into, or None (no room, or ``b`` left every tier meanwhile).
        Finding room may wait for the disk writer with the lock released. Lock held."""
        try:
            off = self.slots.host(slot)
        except TierFull:
            return None  # no room to promote: the prefix so far is what the client gets
        if self.table.get(b.fk) is not b:  # dropped from its last tier while room was made
            self.host.free(off)
            return None
        return off

    def _moved(self, b: Block, off: int | None, slot: int, loads: list[Block]) -> str | None:
        """``b`` changed while room was made for it (another request promoted it, or its copy left a
        tier): give ``off`` back and look again. Lock held."""
        if off is None:
            return None
        self.host.free(off)
        return self._lease_source(b, slot, loads)

    def _fetch_remote(self, s: Session, ns: Namespace, keys: list[bytes], slot: int, leased: list[Block],
                      tiers: list[str]) -> None:
        """Continue a fetch from the remote tier: the part of the prefix no local tier holds."""
        assert self.remote is not None  # called only with a remote tier
        n = self.remote.prefix_len(s.fp, keys)  # network: outside the lock
        if n == 0:
            return
        loads: list[Block] = []
        table = self.table
        with self.ctx.lock:
            for k in keys[:n]:
                fk = s.fp + k
                if fk in table:  # appeared meanwhile (another client): end the prefix here
                    break
                try:
                    off = self.slots.host(slot)
                except TierFull:
                    break
                if fk in table:  # room was made with the lock released: it may have appeared
                    self.host.free(off)
                    break
                b = table.add(Block(fk, ns.layout.block_bytes))
                self.m.remote.found(b)
                self.transfers.prepare_load(b, off)
                self.hostm.lease(b)
                loads.append(b)
                leased.append(b)
                tiers.append("remote")
            if not loads:
                return
        self.transfers.load_remote(loads)

    def acquire(self, s: Session, ns: Namespace, keys: list[bytes]) -> tuple[int, list[int], list[str]]:
        """Lease the longest cached prefix in host memory, waiting for its promotions: :meth:`fetch`,
        then :meth:`wait` without a timeout."""
        return self.wait(s, self.fetch(s, ns, keys), None)

    # ---- wait -------------------------------------------------------------------------------------
    def wait(self, s: Session, ticket: int, timeout: float | None) -> tuple[int, list[int], list[str]]:
        """Turn a ticket (of a host or a GPU fetch) into a lease on the exact prefix that arrived within
        ``timeout`` seconds.

        Blocks still loading after the timeout are cut off (a partial result is normal); their loads
        finish in the background and stay cached.
        """
        with self.ctx.lock:
            leased, tiers, tier = self.table.take_ticket(s, ticket)
        gpu = tier == "gpu"
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        cut = len(leased)
        for i, b in enumerate(leased):
            ev = b.gpu_loading if gpu else b.loading
            if ev is not None and not ev.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                cut = i
                break
            if (b.gpu_off is None or b.gpu_loading is not None) if gpu else (b.load_failed or b.host_off is None):
                cut = i
                break
        with self.ctx.lock:
            manager = self.m.gpu if gpu else self.hostm
            for b in leased[cut:]:
                manager.unlease(b)
            lease = self.table.hold(s, ticket, leased[:cut], tier)
            self.ctx.notify()
            offs: list[int] = []
            for b in lease.blocks:
                off = b.gpu_off if gpu else b.host_off
                assert off is not None  # the lease ends before the first block without its slot
                offs.append(off)
            return lease.id, offs, tiers[:cut]

    # ---- prefetch and plan ------------------------------------------------------------------------
    def prefetch(self, s: Session, ns: Namespace, keys: list[bytes]) -> int:
        """Promote the disk-only blocks of the cached prefix into host memory; returns loads started.

        Prefetched blocks not used yet hold at most ``host.prefetch_fraction`` of the host tier, and
        room is made only from clean blocks no one is using: a queue of announced requests never
        evicts what running requests lease, nor costs a block its disk copy."""
        slot = slot_size_for(ns.layout.block_bytes)
        loads: list[Block] = []
        with self.ctx.lock:
            room = self._prefetch_room(slot)
            for b in self.table.prefix(s.fp, keys):
                if b.host_off is None and b.on_disk:
                    if room <= 0:
                        break
                    try:
                        off = self.slots.host(slot, wait=False, drop_dirty=False)
                    except TierFull:
                        break
                    self.transfers.prepare_load(b, off)
                    loads.append(b)
                    self._warm[b.fk] = (b, b.hits)
                    room -= 1
            if loads:
                self.hostm.prefetching(len(loads))
                self.transfers.load(ns, loads)
        return len(loads)

    def _prefetch_room(self, slot: int) -> int:
        """Blocks a prefetch may still bring in under the budget (forgets blocks used or gone). Lock held."""
        hp = self.hostm
        for fk, (b, hits) in list(self._warm.items()):
            if b.host_off is None or b.hits != hits or b.leases > 0:
                del self._warm[fk]
        budget = int(self.ctx.cfg.host.prefetch_fraction * hp.limit) // max(slot, 1)
        return budget - len(self._warm)

    def plan(self, s: Session, ns: Namespace, keys: list[bytes]) -> dict:
        """Where each leading cached block is, whether it is ready in host memory, how many leading
        blocks are worth fetching rather than recomputing (from the measured cost model), the seconds
        recomputing the first 1, 2, ... of ``keys`` would take (held here or not: a remote tier's too)
        and where that recompute speed comes from (``measured``, ``engine`` or ``prior``)."""
        with self.ctx.lock:
            found = self.table.prefix(s.fp, keys)
            tiers = [tier_of(b) for b in found]
            ready = [b.host_ready or b.gpu_ready for b in found]
        bt, bb = ns.layout.block_tokens, ns.layout.block_bytes
        runs = []
        for tier, group in itertools.groupby(("host" if r else "disk" for r in ready)):
            n = len(list(group))
            runs.append(Run(tier, n * bb, n * bt))
        plans = self.cost.plan(runs) if runs else []
        fetch = 0
        for p in plans:
            if not p.fetch:
                break
            fetch += p.tokens // bt
        return {"count": len(tiers), "tiers": tiers, "ready": ready, "fetch": fetch,
                "runs": [{"tier": p.tier, "blocks": p.tokens // bt, "fetch": p.fetch,
                          "fetch_s": p.fetch_s, "recompute_s": p.recompute_s} for p in plans],
                "prefix_recompute_s": self.cost.prefix_recompute_seconds(bt, len(keys)),
                "recompute_source": self.cost.recompute_source()}

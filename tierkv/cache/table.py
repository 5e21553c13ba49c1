"""Block table: where each block lives, who holds it, and what moves next. It decides; the transfer
engine moves bytes.

Blocks are immutable and content-addressed by ``fingerprint + key`` (the LMDB key too). A block may be
in the GPU tier (a slot in the device pool), the host tier (a slot in the shared pool), on disk, or in
several. Leases pin a block's slot in one tier (host or GPU) for a client connection; a leased, loading
or writing block is never evicted. A block committed into the GPU tier is "draining" until its copy
reaches host memory; from there it follows the host tier's write-back. All state changes happen under
one lock; waits on transfers happen outside it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tierkv.cache.costmodel import Run
from tierkv.cache.policy import History, make_policy, policy_class
from tierkv.cache.policy.placement import Placement
from tierkv.cache.policy.reuse import ReuseModel
from tierkv.codecs import CodecError, read_header
from tierkv.core.errors import BadRequest, TierFull, TierKVError
from tierkv.core.keys import FINGERPRINT_BYTES, MAX_KEY_BYTES, Namespace
from tierkv.core.lookup_index import IndexedBlocks, LookupIndex
from tierkv.core.lookup_index import available as lookup_index_available
from tierkv.daemon.config import Config
from tierkv.daemon.stats import TierCounters
from tierkv.movers.streams import Copy
from tierkv.movers.transfer import Job, Move, TransferEngine
from tierkv.tiers.disk import DiskTier, stored_size
from tierkv.tiers.host import HostPool, slot_size_for

log = logging.getLogger("tierkv.table")
HISTORY_ENTRIES = 1 << 16


@dataclass(slots=True, eq=False)
class Block:
    """One block's record."""

    fk: bytes                      # fingerprint + key
    nbytes: int                    # raw bytes (the namespace's block size)
    host_off: int | None = None    # slot offset in the host pool
    on_disk: bool = False
    disk_bytes: int = 0            # encoded bytes on disk
    leases: int = 0
    writing: int = 0               # host -> disk/remote stores in flight (they read the slot)
    on_remote: bool = False        # known to be in the remote tier
    loading: threading.Event | None = None  # set when a disk -> host load finishes
    load_failed: bool = False
    hits: int = 0
    pin: int = 0                   # retention priority of a pinned prefix (0 = not pinned)
    mass: float = 1.0              # last attention mass a client reported (1.0 = uniform)
    gpu_off: int | None = None     # slot offset in the GPU tier's device pool
    gpu_leases: int = 0
    gpu_loading: threading.Event | None = None  # set when a host -> gpu copy finishes
    draining: bool = False         # committed on the GPU, its host copy not made yet (the only copy)
    parent: bytes | None = None    # the previous block of the chain it was stored in (tails go first)

    @property
    def protected(self) -> bool:
        """The host slot must stay (read by a client or a transfer, or pinned)."""
        return self.leases > 0 or self.writing or self.loading is not None or self.pin > 0

    @property
    def gpu_protected(self) -> bool:
        """The GPU slot must stay (read by a client, being filled, or the only copy)."""
        return self.gpu_leases > 0 or self.gpu_loading is not None or self.draining

    @property
    def busy(self) -> bool:
        """Any tier's copy is in use: a delete must skip the block."""
        return self.protected or self.gpu_protected


@dataclass
class Lease:
    """Blocks pinned in host memory for one connection."""

    id: int
    blocks: list[Block]
    tier: str = "host"             # which slot the lease pins: "host" or "gpu"


@dataclass
class Session:
    """Per-connection state: its namespace, unclaimed slots and leases (all freed when it closes)."""

    id: int
    rid: int = 0                   # request id being served (replies echo it)
    ns: Namespace | None = None
    fp: bytes = b""
    slots: dict[int, int] = field(default_factory=dict)   # offset -> slot size, allocated but not committed
    gpu_slots: dict[int, int] = field(default_factory=dict)  # the same for the GPU tier
    leases: dict[int, Lease] = field(default_factory=dict)
    # fetches not yet waited: blocks, their source tiers, and the tier they are leased in
    tickets: dict[int, tuple[list[Block], list[str], str]] = field(default_factory=dict)
    # durable writes committed with wait=False, not yet waited for by SYNC
    pending: list[Job] = field(default_factory=list)


def validate_keys(keys: object, limit: int = 1 << 16) -> list[bytes]:
    """Check a key list from the wire; raise BadRequest naming the problem."""
    if not isinstance(keys, list):
        raise BadRequest("keys must be a list of bytes")
    if len(keys) > limit:
        raise BadRequest(f"too many keys in one request ({len(keys)} > {limit})")
    for k in keys:  # a plain loop: about half the cost of all(<generator>) on a hot path (lookup)
        if type(k) is not bytes or not 0 < len(k) <= MAX_KEY_BYTES:
            raise BadRequest(f"each key must be 1..{MAX_KEY_BYTES} bytes")
    return keys


class BlockTable:
    """All block records plus the host pool, the disk tier and the transfer engine."""

    def __init__(self, cfg: Config, data_dir: str) -> None:
        self.cfg = cfg
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        # Every key of a local tier, mirrored into the shared lookup index clients read (when built).
        self.index: LookupIndex | None = None
        self.blocks: dict[bytes, Block] = {}
        if cfg.server.lookup_index_slots and lookup_index_available():
            self.index = LookupIndex(1 << (cfg.server.lookup_index_slots - 1).bit_length())
            self.blocks = IndexedBlocks(self.index)
        self.namespaces: dict[bytes, Namespace] = {}
        self.ns_blocks: dict[bytes, int] = {}
        self.ns_hits: dict[bytes, list[int]] = {}  # fingerprint -> [blocks fetches got, blocks they missed]
        self._ns_sessions: dict[bytes, int] = {}  # connections bound to each namespace
        self.host = HostPool(cfg.host.capacity, cfg.host.slab_bytes, cfg.host.prefault)
        # One use history for both tiers (heat survives demotion), bounded so that a stream of
        # one-shot keys cannot grow the daemon's memory (~150 B a record).
        self.history = History(max_entries=HISTORY_ENTRIES)
        # Which host blocks come back once they leave host memory (the host policy's reuse term).
        self.host_reuse = ReuseModel(max_records=HISTORY_ENTRIES)
        self.host_policy = self._make_policy(cfg.host.policy, cfg, host=True)
        self.disk_policy = self._make_policy(cfg.disk.policy, cfg)
        self.host_limit = self.host.capacity  # effective capacity: `tune host.capacity` can lower it
        self.pinned_bytes = 0
        # Which host victims reach disk: learned from requests, stores and the engine's signals. Its own
        # history: the policies count uses with decay, admission counts each request once.
        self.placement = Placement(cfg.disk.admission, max_records=HISTORY_ENTRIES,
                                   ghost_entries=HISTORY_ENTRIES // 2)
        self.host_stats = TierCounters()
        self.disk_stats = TierCounters()
        self.disk: DiskTier | None = None
        self.disk_used = 0
        self.degraded = ""
        self._lease_ids = 0
        self._closing = False
        self._kick = threading.Event()
        self._force = False
        if cfg.disk.enabled:
            from pathlib import Path

            from tierkv.core.faults import disk_fault_from_env

            self.disk = DiskTier(Path(data_dir) / "disk", cfg.disk.capacity, cfg.disk.sync)
            self.disk.fault = disk_fault_from_env()
        self.engine = TransferEngine(self.disk, cfg.disk.workers, cfg.disk.codec, cfg.disk.codec_level,
                                     make_room=self._make_disk_room, write_batch=cfg.disk.write_batch,
                                     budgets={"host<->disk": cfg.budget.host_disk or None,
                                              "gpu<->host": cfg.budget.gpu_host or None,
                                              "host<->remote": cfg.budget.host_remote or None})
        self.gpu = None
        self.gpu_stats = TierCounters()
        self.gpu_policy = make_policy("lru")  # device slots are few and clean once drained: plain recency
        self._undrained: list[Block] = []     # GPU commits waiting for a host slot to drain into
        self._wb_job: Job | None = None       # the write-behind batch in flight
        self._host_t = None                   # torch view of the whole host pool (GPU copies)
        self.written_behind = 0
        if cfg.gpu.capacity:
            from tierkv.tiers.gpu import DevicePool

            self.gpu = DevicePool(cfg.gpu.capacity, min(cfg.gpu.slab_bytes, cfg.gpu.capacity), cfg.gpu.device)
            try:
                self.engine.attach_device(self.gpu, self.host)
            except Exception:
                self.gpu.close()
                raise
        self.remote = None
        self.remote_stats = TierCounters()
        self._remote_info: tuple[float, dict | None] = (0.0, None)
        if cfg.remote.url:
            from tierkv.tiers.remote import RemoteTier

            self.remote = RemoteTier.from_config(cfg.remote)
        if self.disk is not None:
            self._scan_disk()
        self._evictor = threading.Thread(target=self._evict_loop, name="tierkv-evictor", daemon=True)
        self._evictor.start()

    # ---- start-up ---------------------------------------------------------------------------------
    def _scan_disk(self) -> None:
        """Rebuild records of every block on disk; a value with a bad header is dropped."""
        assert self.disk is not None
        bad: list[bytes] = []
        t0 = time.perf_counter()
        for lk, value in self.disk.scan():
            try:
                h = read_header(value)
            except CodecError:
                bad.append(lk)
                continue
            if len(lk) <= FINGERPRINT_BYTES or bytes(h.fingerprint) != lk[:FINGERPRINT_BYTES]:
                bad.append(lk)
                continue
            b = Block(lk, h.raw_len, on_disk=True, disk_bytes=len(value))
            self.blocks[lk] = b
            fp = lk[:FINGERPRINT_BYTES]
            self.ns_blocks[fp] = self.ns_blocks.get(fp, 0) + 1  # _forget counts it down again
            self._disk_added(b)
        # The scan reads headers through its own page walk; a value is dropped only if LMDB's own read
        # agrees that it is bad (a walk that went wrong must never cost stored blocks).
        bad = [lk for lk in bad if not self._header_ok_via_lmdb(lk)]
        if bad:
            self.disk.delete(bad)
            self.disk_stats.corrupt += len(bad)
        log.info("disk tier: %d blocks (%d dropped as corrupt) scanned in %.2fs", len(self.blocks), len(bad),
                 time.perf_counter() - t0)

    def _header_ok_via_lmdb(self, lk: bytes) -> bool:
        """Re-check a value the start-up scan found bad, read through LMDB; a good one is recorded."""
        assert self.disk is not None

        def check(value: memoryview) -> int:
            h = read_header(value)
            if len(lk) <= FINGERPRINT_BYTES or bytes(h.fingerprint) != lk[:FINGERPRINT_BYTES]:
                raise CodecError("namespace fingerprint differs from the key's")
            b = Block(lk, h.raw_len, on_disk=True, disk_bytes=len(value))
            self.blocks[lk] = b
            self.ns_blocks[lk[:FINGERPRINT_BYTES]] = self.ns_blocks.get(lk[:FINGERPRINT_BYTES], 0) + 1
            self._disk_added(b)
            return 1

        try:
            return bool(self.disk.read(lk, check))
        except (CodecError, TierKVError):
            return False

    # ---- namespaces and sessions ------------------------------------------------------------------
    def register(self, session: Session, ns: Namespace) -> None:
        """Bind a connection to its namespace (once: its slots and leases are sized for it)."""
        slot = slot_size_for(ns.layout.block_bytes)
        if slot > self.host.slab_bytes:
            raise BadRequest(f"a block of {ns.layout.block_bytes} bytes exceeds the host slab size "
                             f"({self.host.slab_bytes}); raise host.slab_bytes")
        with self.lock:
            if session.ns is not None:
                if session.ns != ns:
                    raise BadRequest("this connection is bound to another namespace; open a new connection")
                return
            session.ns, session.fp = ns, ns.fingerprint
            self.namespaces.setdefault(session.fp, ns)
            self._ns_sessions[session.fp] = self._ns_sessions.get(session.fp, 0) + 1

    def close_session(self, session: Session) -> None:
        """Release everything a connection held (it may have died without a word)."""
        with self.lock:
            for lease in session.leases.values():
                for b in lease.blocks:
                    self._unlease(b, lease.tier)
            session.leases.clear()
            for leased, _tiers, tier in session.tickets.values():
                for b in leased:
                    self._unlease(b, tier)
            session.tickets.clear()
            for off in session.slots:
                self.host.free(off)
            session.slots.clear()
            for off in session.gpu_slots:
                self.gpu.free(off)  # type: ignore[union-attr]
            session.gpu_slots.clear()
            if session.ns is not None:
                fp = session.fp
                self._ns_sessions[fp] -= 1
                if self._ns_sessions[fp] == 0 and self.ns_blocks.get(fp, 0) <= 0:
                    # nobody uses it and it holds no block: forget it (HELLOs must not grow memory)
                    del self._ns_sessions[fp]
                    self.namespaces.pop(fp, None)
                    self.ns_blocks.pop(fp, None)
                    self.ns_hits.pop(fp, None)
                session.ns = None
            self.changed.notify_all()

    # ---- store path -------------------------------------------------------------------------------
    def alloc(self, s: Session, n: int, keys: list[bytes] | None = None, tier: str = "host") -> list[int | None]:
        """Slots of ``tier`` for ``n`` new blocks (None where ``keys[i]`` is already cached: nothing to write)."""
        ns = self._ns(s)
        if not isinstance(n, int) or n < 0:
            raise BadRequest("n must be a non-negative int")
        if keys is not None and len(keys) != n:
            raise BadRequest("keys and n disagree")
        if self._tier(tier) == "gpu":
            return self._alloc_gpu(s, ns, n, keys)
        slot = slot_size_for(ns.layout.block_bytes)
        if n * slot > self.host_limit:
            raise BadRequest(f"{n} blocks of {slot} bytes exceed the host tier ({self.host_limit} bytes)")
        with self.lock:
            new = n if keys is None else sum(1 for k in keys if (s.fp + k) not in self.blocks)
            self._make_host_room(new * slot)
            return self._take_slots(s, n, keys, slot, lambda: self._alloc_slot(slot), s.slots, self.host.free)

    def _take_slots(self, s: Session, n: int, keys: list[bytes] | None, slot: int, take: Callable[[], int],
                    owned: dict[int, int], free: Callable[[int], None]) -> list[int | None]:
        """Slots from ``take`` for the blocks not cached yet (None for cached keys), recorded in the
        connection's ``owned``; all given back if the tier fills on the way. Lock held."""
        out: list[int | None] = []
        try:
            for i in range(n):
                if keys is not None and (s.fp + keys[i]) in self.blocks:
                    out.append(None)
                    continue
                off = take()
                owned[off] = slot
                out.append(off)
        except TierFull:
            for off in out:
                if off is not None:
                    owned.pop(off, None)
                    free(off)
            raise
        return out

    def commit(self, s: Session, keys: list[bytes], offsets: list[int], durable: bool = False,
               tier: str = "host", wait: bool = True) -> int:
        """Publish written slots under ``keys``; returns how many were new (the rest deduplicated).

        ``durable`` with ``wait=False`` (host tier): return once the disk write is queued; :meth:`sync`
        waits for it (a client streams a large durable put: its next copy overlaps this write)."""
        ns = self._ns(s)
        if len(keys) != len(offsets):
            raise BadRequest("keys and slots differ in length")
        if durable and self.disk is None:
            raise BadRequest("durable=True needs the disk tier, which is disabled")
        if self._tier(tier) == "gpu":
            return self._commit_gpu(s, ns, keys, offsets, durable)
        fks = [s.fp + k for k in keys]
        new: list[Block] = []
        durable_blocks: list[Block] = []
        with self.lock:
            for off in offsets:
                if not isinstance(off, int) or off not in s.slots:
                    raise BadRequest(f"slot {off!r} was not allocated by this connection")
            if len(set(offsets)) != len(offsets):
                raise BadRequest("a slot appears twice")
            parent = None
            for fk, off in zip(fks, offsets):
                del s.slots[off]
                b = self.blocks.get(fk)
                if b is None:
                    b = Block(fk, ns.layout.block_bytes, host_off=off, parent=parent)
                    self.blocks[fk] = b
                    self.ns_blocks[s.fp] = self.ns_blocks.get(s.fp, 0) + 1
                    self.host_policy.on_insert(fk, self.host.slot_size_at(off), parent)
                    self.host_policy.on_access(fk)  # a store is a use (insert alone is not counted)
                    self.host_stats.bytes_in += b.nbytes
                    new.append(b)
                elif b.host_off is None and b.loading is None:
                    b.host_off = off  # on disk only: keep the fresh copy hot instead of reading it back
                    self.host_policy.on_insert(fk, self.host.slot_size_at(off), parent)
                else:
                    self.host.free(off)  # deduplicated
                    self._touch(b)
                if durable and not b.on_disk:
                    durable_blocks.append(b)
                parent = fk
            self._write_through(new)
            now = time.monotonic()
            self.host_reuse.stored(fks, now)
            if self.cfg.disk.admission == "predicted":
                self.placement.stored(fks, now)
            job = self._store(durable_blocks) if durable_blocks else None
            if job is not None and not wait:
                s.pending.append(job)
                job = None
            self.changed.notify_all()
        if job is not None:
            job.wait()
            if job.error is not None or not all(m.ok for m in job.moves):
                raise job.error or TierFull("durable write failed")
        self._kick_evictor()
        return len(new)

    def sync(self, s: Session) -> None:
        """Wait for the durable writes this connection committed with ``wait=False``.

        Raises:
            TierKVError: one of them failed (the first error); every one was waited for.
        """
        with self.lock:
            jobs, s.pending = s.pending, []
        failed: TierKVError | None = None
        for job in jobs:
            job.wait()
            if failed is None and (job.error is not None or not all(m.ok for m in job.moves)):
                failed = job.error or TierFull("durable write failed")
        if failed is not None:
            raise failed

    def abort(self, s: Session, offsets: list[int], tier: str = "host") -> None:
        """Give back allocated slots without committing them."""
        gpu = self._tier(tier) == "gpu"
        pool, mine = (self.gpu, s.gpu_slots) if gpu else (self.host, s.slots)
        with self.lock:
            for off in offsets:
                if off in mine:
                    del mine[off]
                    pool.free(off)  # type: ignore[union-attr]
            self.changed.notify_all()

    # ---- GPU tier: store path -----------------------------------------------------------------------
    def _alloc_gpu(self, s: Session, ns: Namespace, n: int, keys: list[bytes] | None) -> list[int | None]:
        assert self.gpu is not None
        slot = slot_size_for(ns.layout.block_bytes)
        if slot > self.gpu.slab_bytes:
            raise BadRequest(f"a block of {ns.layout.block_bytes} bytes exceeds the GPU slab size "
                             f"({self.gpu.slab_bytes}); raise gpu.slab_bytes")
        if n * slot > self.gpu.capacity:
            raise BadRequest(f"{n} blocks of {slot} bytes exceed the GPU tier ({self.gpu.capacity} bytes)")
        with self.lock:
            return self._take_slots(s, n, keys, slot, lambda: self._alloc_gpu_slot(slot), s.gpu_slots,
                                    self.gpu.free)

    def _commit_gpu(self, s: Session, ns: Namespace, keys: list[bytes], offsets: list[int], durable: bool) -> int:
        """Publish GPU slots; their copies to host memory (then disk) go on in the background."""
        assert self.gpu is not None
        fks = [s.fp + k for k in keys]
        new: list[Block] = []
        durable_blocks: list[Block] = []
        with self.lock:
            for off in offsets:
                if not isinstance(off, int) or off not in s.gpu_slots:
                    raise BadRequest(f"GPU slot {off!r} was not allocated by this connection")
            if len(set(offsets)) != len(offsets):
                raise BadRequest("a slot appears twice")
            for fk, off in zip(fks, offsets):
                del s.gpu_slots[off]
                b = self.blocks.get(fk)
                if b is None:
                    b = Block(fk, ns.layout.block_bytes, gpu_off=off, draining=True)
                    self.blocks[fk] = b
                    self.ns_blocks[s.fp] = self.ns_blocks.get(s.fp, 0) + 1
                    self.gpu_policy.on_insert(fk, self.gpu.slot_size_at(off), None)
                    self.gpu_stats.bytes_in += b.nbytes
                    new.append(b)
                elif b.gpu_off is None and b.gpu_loading is None:
                    b.gpu_off = off  # cached in a colder tier: keep the fresh device copy hot
                    self.gpu_policy.on_insert(fk, self.gpu.slot_size_at(off), None)
                else:
                    self.gpu.free(off)  # deduplicated
                    self._touch(b)
                if durable and not b.on_disk:
                    durable_blocks.append(b)
            self._drain(new)
            self.changed.notify_all()
        if durable_blocks:
            self._make_durable(durable_blocks)
        return len(new)

    def _make_durable(self, blocks: list[Block]) -> None:
        """Wait for GPU commits to reach host memory, then write them to disk and wait for the sync."""
        deadline = time.monotonic() + max(30.0, self.cfg.server.drain_timeout_s)
        with self.lock:
            while any(b.draining for b in blocks):
                if self._closing or time.monotonic() > deadline:
                    raise TierFull("durable write failed: blocks did not reach host memory in time")
                self.changed.wait(0.05)
            todo = [b for b in blocks if not b.on_disk and b.host_off is not None and b.loading is None]
            job = self._store(todo) if todo else None
        if job is not None:
            job.wait()
            if job.error is not None or not all(m.ok for m in job.moves):
                raise job.error or TierFull("durable write failed")

    def _drain(self, blocks: list[Block]) -> None:
        """Copy GPU commits into host slots (the store queue; never waits for room). Lock held."""
        started: list[Block] = []
        for i, b in enumerate(blocks):
            if b.fk not in self.blocks or b.gpu_off is None or not b.draining:
                continue  # deleted meanwhile
            try:
                b.host_off = self._alloc_slot(slot_size_for(b.nbytes), wait=False)
            except TierFull:
                # host memory is full of blocks still being written back: retry when the evictor frees some
                self._undrained.extend(x for x in blocks[i:] if x.draining)
                self._kick_evictor(force=True)
                break
            started.append(b)
        self._copy_to_host(started)

    def _copy_to_host(self, blocks: list[Block]) -> None:
        """GPU slot -> the host slot already assigned to each block, on the store queue. Lock held."""
        if not blocks:
            return
        assert self.gpu is not None
        copies: list[Copy] = []
        for b in blocks:
            b.loading = threading.Event()
            b.load_failed = False
            b.gpu_leases += 1  # the GPU slot is the copy's source
            copies.append(Copy(self.gpu.view(b.gpu_off, b.nbytes), self._host_tensor(b.host_off, b.nbytes)))

        def done(cs: list[Copy]) -> None:
            with self.lock:
                for b, c in zip(blocks, cs):
                    ev, b.loading = b.loading, None
                    b.gpu_leases -= 1
                    if c.ok:
                        b.draining = False
                        self.host_policy.on_insert(b.fk, self.host.slot_size_at(b.host_off), b.parent)  # type: ignore
                        self.host_stats.bytes_in += b.nbytes
                        self.gpu_stats.demotions += 1
                    else:
                        b.load_failed = True
                        self.host.free(b.host_off)  # type: ignore[arg-type]
                        b.host_off = None
                        self.gpu_stats.errors += 1
                        if b.draining:
                            self._undrained.append(b)  # the GPU copy is the only one: try again later
                    if ev is not None:
                        ev.set()
                self._write_through([b for b in blocks if b.host_off is not None])
                self.changed.notify_all()
            self._kick_evictor()

        self.engine.to_host(copies, done)

    def _retry_drains(self) -> None:
        with self.lock:
            pending, self._undrained = self._undrained, []
            self._drain(pending)

    def _alloc_gpu_slot(self, slot: int, wait: bool = True) -> int:
        """A GPU slot, dropping clean device copies (or, with ``wait``, waiting for drains). Lock held."""
        assert self.gpu is not None
        deadline = None
        while True:
            off = self.gpu.alloc(slot)
            if off is not None:
                return off
            victims = self.gpu_policy.victims(slot, self._gpu_protected)
            if victims:
                for fk in victims:
                    self._drop_gpu(self.blocks[fk])
                continue
            if not wait or self._closing:
                raise TierFull("GPU tier has no evictable block right now")
            if deadline is None:
                deadline = time.monotonic() + 30.0
            if time.monotonic() > deadline or not any(b.draining for b in self._gpu_blocks()):
                raise TierFull("GPU tier is full: every block is leased or being filled")
            self.changed.wait(0.05)

    def _gpu_blocks(self) -> Iterable[Block]:
        return (b for b in self.blocks.values() if b.gpu_off is not None)

    def _gpu_protected(self, fk: bytes) -> bool:
        return self.blocks[fk].gpu_protected

    def _drop_gpu(self, b: Block) -> None:
        """Free a block's GPU slot; it stays in the colder tiers that hold it. Lock held."""
        self.gpu_policy.on_remove(b.fk)
        self.gpu.free(b.gpu_off)  # type: ignore[union-attr]
        b.gpu_off = None
        self.gpu_stats.evictions += 1
        if b.host_off is None and not b.on_disk:
            self._forget(b)

    # ---- load path --------------------------------------------------------------------------------
    def lookup(self, s: Session, keys: list[bytes]) -> list[str]:
        """Tier of each leading cached block ("host" or "disk"); stops at the first miss."""
        self._ns(s)
        out: list[str] = []
        fp, get, add = s.fp, self.blocks.get, out.append
        with self.lock:
            for k in keys:
                b = get(fp + k)
                if b is None:
                    break
                add(_tier_of(b))
        if self.remote is not None and len(out) < len(keys):
            # Only the part of the prefix no local tier holds, in one round trip (outside the lock).
            out += ["remote"] * self.remote.prefix_len(s.fp, keys[len(out):])
        return out

    def lookup_count(self, s: Session, keys: list[bytes]) -> int:
        """``len(self.lookup(s, keys))`` without naming the tiers: the scheduler's hot path, one C-level
        walk of the table (about half the cost of :meth:`lookup` for 64 keys)."""
        self._ns(s)
        fp = s.fp
        fks = [fp + k for k in keys]
        with self.lock:
            found = list(map(self.blocks.get, fks))
        try:
            n = found.index(None)  # Block compares by identity: a C-level scan
        except ValueError:
            return len(found)  # every key is cached locally
        if self.remote is not None:
            n += self.remote.prefix_len(fp, keys[n:])  # outside the lock, as in lookup
        return n

    def acquire(self, s: Session, keys: list[bytes], tier: str = "host") -> tuple[int, list[int], list[str]]:
        """Lease the longest cached prefix in host memory (or GPU memory), promoting as needed.

        Returns:
            (lease id, slot offsets of the leased prefix, tier each block came from).
        """
        return self.wait(s, self.fetch(s, keys, tier), None)

    def fetch(self, s: Session, keys: list[bytes], tier: str = "host") -> int:
        """Start leasing the cached prefix of ``keys``: host blocks at once, disk blocks as their loads
        finish. Returns a ticket for :meth:`wait`; never blocks on the disk. With ``tier="gpu"`` the
        lease is on GPU slots, promoted from host or disk in the background."""
        ns = self._ns(s)
        self._requested(s, keys)
        if self._tier(tier) == "gpu":
            leased, tiers = self._promote_gpu(s, ns, keys, lease=True)
            with self.lock:
                self._lease_ids += 1
                self._count_fetch(s.fp, len(keys), len(leased))
                s.tickets[self._lease_ids] = (leased, tiers, "gpu")
                return self._lease_ids
        slot = slot_size_for(ns.layout.block_bytes)
        leased: list[Block] = []
        tiers: list[str] = []
        loads: list[Block] = []
        with self.lock:
            for k in keys:
                b = self.blocks.get(s.fp + k)
                if b is None:
                    self.host_stats.misses += 1
                    break
                if b.host_off is not None:
                    # a slot still being filled names its source: the GPU for a drain, else the disk
                    tiers.append("host" if b.loading is None else "gpu" if b.draining else "disk")
                    self.host_stats.hits += 1
                    self.host_stats.bytes_out += b.nbytes  # leased to the client: read from the host tier
                elif b.on_disk:
                    try:
                        b.host_off = self._alloc_slot(slot)
                    except TierFull:
                        break  # no room to promote: the prefix so far is what the client gets
                    b.loading = threading.Event()
                    b.load_failed = False
                    loads.append(b)
                    tiers.append("disk")
                    self.host_stats.misses += 1
                elif b.gpu_off is not None and b.gpu_loading is None and not b.draining:
                    try:  # only on the GPU (its host copy was dropped unwritten): copy it back down
                        b.host_off = self._alloc_slot(slot)
                    except TierFull:
                        break
                    self._copy_to_host([b])
                    tiers.append("gpu")
                    self.host_stats.misses += 1
                else:
                    break
                b.leases += 1
                self._touch(b)
                leased.append(b)
            if loads:
                self._load(ns, loads)
            self._write_through([b for b in leased if b.loading is None])
        if self.remote is not None and len(leased) < len(keys) and (not leased or leased[-1] is not None):
            self._fetch_remote(s, ns, keys[len(leased):], slot, leased, tiers)
        with self.lock:
            self._lease_ids += 1
            self._count_fetch(s.fp, len(keys), len(leased))
            s.tickets[self._lease_ids] = (leased, tiers, "host")
            return self._lease_ids

    def _count_fetch(self, fp: bytes, asked: int, got: int) -> None:
        c = self.ns_hits.setdefault(fp, [0, 0])
        c[0] += got
        c[1] += asked - got

    def _fetch_remote(self, s: Session, ns: Namespace, keys: list[bytes], slot: int, leased: list[Block],
                      tiers: list[str]) -> None:
        """Continue a fetch from the remote tier: the part of the prefix no local tier holds."""
        assert self.remote is not None
        n = self.remote.prefix_len(s.fp, keys)  # network: outside the lock
        if n == 0:
            return
        loads: list[Block] = []
        with self.lock:
            for k in keys[:n]:
                fk = s.fp + k
                if fk in self.blocks:  # appeared meanwhile (another client): end the prefix here
                    break
                try:
                    off = self._alloc_slot(slot)
                except TierFull:
                    break
                b = Block(fk, ns.layout.block_bytes, host_off=off, on_remote=True, leases=1)
                b.loading = threading.Event()
                self.blocks[fk] = b
                self.ns_blocks[s.fp] = self.ns_blocks.get(s.fp, 0) + 1
                loads.append(b)
                leased.append(b)
                tiers.append("remote")
            if not loads:
                return
        moves = [Move(b.fk, self.host.view(b.host_off, b.nbytes), ns.layout, s.fp, b.fk[FINGERPRINT_BYTES:])
                 for b in loads]  # type: ignore[arg-type]

        def done(job: Job) -> None:
            with self.lock:
                for b, m in zip(loads, job.moves):
                    ev, b.loading = b.loading, None
                    if m.ok:
                        self.host_policy.on_insert(b.fk, self.host.slot_size_at(b.host_off), b.parent)
                        self.remote_stats.hits += 1
                        self.remote_stats.bytes_out += b.nbytes
                    else:  # a miss (gone, corrupt or the remote is down): never served
                        b.load_failed = True
                        self.host.free(b.host_off)  # type: ignore[arg-type]
                        b.host_off = None
                        self.remote_stats.misses += 1
                        self._forget(b)
                    if ev is not None:
                        ev.set()
                self.changed.notify_all()

        self.engine.load_remote(self.remote, moves, on_done=done)

    def wait(self, s: Session, ticket: int, timeout: float | None) -> tuple[int, list[int], list[str]]:
        """Turn a ticket into a lease on the exact prefix that arrived within ``timeout`` seconds.

        Blocks still loading after the timeout are cut off (a partial result is normal); their loads
        finish in the background and stay cached.
        """
        with self.lock:
            if ticket not in s.tickets:
                raise BadRequest(f"ticket {ticket!r} is not pending on this connection")
            leased, tiers, tier = s.tickets.pop(ticket)
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
        with self.lock:
            for b in leased[cut:]:
                self._unlease(b, tier)
            leased = leased[:cut]
            lease = Lease(ticket, leased, tier)
            s.leases[lease.id] = lease
            self.changed.notify_all()
            offs = [b.gpu_off if gpu else b.host_off for b in leased]
            return lease.id, offs, tiers[:cut]  # type: ignore[return-value]

    def prefetch(self, s: Session, keys: list[bytes], tier: str = "host") -> int:
        """Promote the disk-only blocks of the cached prefix into host memory (or, with ``tier="gpu"``,
        every block not yet on the GPU into GPU memory) in the background (queued requests announced by
        the engine); returns how many loads started. Never blocks."""
        ns = self._ns(s)
        self._requested(s, keys)
        if self._tier(tier) == "gpu":
            return len(self._promote_gpu(s, ns, keys, lease=False)[0])
        slot = slot_size_for(ns.layout.block_bytes)
        loads: list[Block] = []
        with self.lock:
            for k in keys:
                b = self.blocks.get(s.fp + k)
                if b is None:
                    break
                if b.host_off is None and b.on_disk:
                    try:
                        b.host_off = self._alloc_slot(slot, wait=False)
                    except TierFull:
                        break
                    b.loading = threading.Event()
                    b.load_failed = False
                    loads.append(b)
            if loads:
                self._load(ns, loads)
        return len(loads)

    def plan(self, s: Session, keys: list[bytes]) -> dict:
        """Where each leading cached block is, whether it is ready in host memory, and how many leading
        blocks are worth fetching rather than recomputing (from the measured cost model)."""
        ns = self._ns(s)
        tiers: list[str] = []
        ready: list[bool] = []
        with self.lock:
            for k in keys:
                b = self.blocks.get(s.fp + k)
                if b is None:
                    break
                tiers.append(_tier_of(b))
                ready.append((b.host_off is not None and b.loading is None)
                             or (b.gpu_off is not None and b.gpu_loading is None))
        runs = []
        for tier, group in itertools.groupby(("host" if r else "disk" for r in ready)):
            n = len(list(group))
            runs.append(Run(tier, n * ns.layout.block_bytes, n * ns.layout.block_tokens))
        plans = self.engine.cost.plan(runs) if runs else []
        fetch = 0
        for p in plans:
            if not p.fetch:
                break
            fetch += p.tokens // ns.layout.block_tokens
        return {"count": len(tiers), "tiers": tiers, "ready": ready, "fetch": fetch,
                "runs": [{"tier": p.tier, "blocks": p.tokens // ns.layout.block_tokens, "fetch": p.fetch,
                          "fetch_s": p.fetch_s, "recompute_s": p.recompute_s} for p in plans]}

    def touch(self, s: Session, keys: list[bytes], scores: list[float]) -> int:
        """Record attention mass per block (1.0 = uniform) for the policies; returns blocks found."""
        self._ns(s)
        found = 0
        with self.lock:
            for k, mass in zip(keys, scores):
                b = self.blocks.get(s.fp + k)
                if b is None:
                    continue
                found += 1
                b.mass = mass
                if b.fk in self.host_policy:
                    self.host_policy.on_touch(b.fk, mass)
                if b.on_disk:
                    self.disk_policy.on_touch(b.fk, mass)
        return found

    def delete(self, s: Session, keys: list[bytes]) -> int:
        """Drop blocks from every tier (leased or in-flight ones are skipped); returns blocks dropped."""
        self._ns(s)
        gone: list[bytes] = []
        with self.lock:
            for k in keys:
                b = self.blocks.get(s.fp + k)
                if b is None or b.busy:
                    continue
                if b.gpu_off is not None:
                    self.gpu_policy.on_remove(b.fk)
                    self.gpu.free(b.gpu_off)  # type: ignore[union-attr]
                    b.gpu_off = None
                if b.host_off is not None:
                    self.host_policy.on_remove(b.fk)
                    self.host.free(b.host_off)
                    b.host_off = None
                if b.on_disk:
                    gone.append(b.fk)
                self._forget(b)
            self.changed.notify_all()
        if gone and self.disk is not None:
            self.disk.delete(gone)
        return len(keys) - sum(1 for k in keys if (s.fp + k) in self.blocks)

    def release(self, s: Session, lease_ids: Iterable[int]) -> None:
        """End leases; unknown ids (double release, another client's lease) are an error."""
        with self.lock:
            ids = list(lease_ids)
            if len(set(ids)) != len(ids):
                raise BadRequest("a lease id appears twice")
            for lid in ids:
                if lid not in s.leases:
                    raise BadRequest(f"lease {lid!r} is not held by this connection")
            for lid in ids:
                lease = s.leases.pop(lid)
                for b in lease.blocks:
                    self._unlease(b, lease.tier)
            self.changed.notify_all()

    def _unlease(self, b: Block, tier: str) -> None:
        if tier == "gpu":
            b.gpu_leases -= 1
            assert b.gpu_leases >= 0
        else:
            b.leases -= 1
            assert b.leases >= 0

    # ---- GPU tier: load path ------------------------------------------------------------------------
    def _promote_gpu(self, s: Session, ns: Namespace, keys: list[bytes],
                     lease: bool) -> tuple[list[Block], list[str]]:
        """Bring the cached prefix of ``keys`` into GPU slots: blocks already there at once, host blocks by
        a host -> gpu copy on the load queue, disk blocks by a disk load chained to that copy. With
        ``lease`` every block of the prefix is leased on the GPU (the caller's ticket); without, only
        copies start (prefetch). Never waits for a transfer."""
        if self.gpu is None:
            raise BadRequest("the GPU tier is off (start the daemon with --gpu-capacity)")
        slot = slot_size_for(ns.layout.block_bytes)
        leased: list[Block] = []
        tiers: list[str] = []
        loads: list[Block] = []
        moving: list[Block] = []
        copies: list[Copy] = []
        with self.lock:
            for k in keys:
                b = self.blocks.get(s.fp + k)
                if b is None:
                    self.gpu_stats.misses += 1
                    break
                if b.gpu_off is not None:
                    self.gpu_stats.hits += 1
                    self.gpu_policy.on_access(b.fk)
                    b.hits += 1
                    if lease:
                        b.gpu_leases += 1
                        leased.append(b)
                        tiers.append("gpu")
                    continue
                source = "host"
                if b.host_off is None:
                    if not b.on_disk:
                        break
                    try:
                        off = self._alloc_slot(slot, wait=False)
                    except TierFull:
                        break
                    b.host_off, b.loading, b.load_failed = off, threading.Event(), False
                    loads.append(b)
                    source = "disk"
                elif b.loading is not None:
                    source = "disk"  # already coming from disk (or draining): the copy waits for it
                try:
                    goff = self._alloc_gpu_slot(slot, wait=False)
                except TierFull:
                    break  # no room on the GPU: the prefix so far is what the client gets
                self.gpu_stats.misses += 1
                self._touch(b)
                b.gpu_off, b.gpu_loading = goff, threading.Event()
                b.leases += 1  # the host slot is the copy's source: keep it until the copy is done
                moving.append(b)
                copies.append(Copy(self._host_tensor(b.host_off, b.nbytes), self.gpu.view(goff, b.nbytes),
                                   ready=None if b.loading is None else _ready(b, b.loading)))
                if lease:
                    b.gpu_leases += 1
                    leased.append(b)
                    tiers.append(source)
            if loads:
                self._load(ns, loads)
        if copies:
            def done(cs: list[Copy]) -> None:
                with self.lock:
                    for b, c in zip(moving, cs):
                        ev, b.gpu_loading = b.gpu_loading, None
                        b.leases -= 1
                        if c.ok:
                            self.gpu_policy.on_insert(b.fk, self.gpu.slot_size_at(b.gpu_off), None)  # type: ignore
                            self.gpu_stats.promotions += 1
                            self.gpu_stats.bytes_in += b.nbytes
                        else:  # its source never arrived (a bad disk value): a miss, never served
                            self.gpu.free(b.gpu_off)  # type: ignore[union-attr]
                            b.gpu_off = None
                        if ev is not None:
                            ev.set()
                    self.changed.notify_all()

            self.engine.to_device(copies, done)
        return (leased if lease else moving), tiers

    def _load(self, ns: Namespace, blocks: list[Block]) -> Job:
        moves = [Move(b.fk, self.host.view(b.host_off, b.nbytes), ns.layout, b.fk[:FINGERPRINT_BYTES],
                      b.fk[FINGERPRINT_BYTES:]) for b in blocks]  # type: ignore[arg-type]

        def done(job: Job) -> None:
            with self.lock:
                bad: list[bytes] = []
                for b, m in zip(blocks, job.moves):
                    ev = b.loading
                    b.loading = None
                    if m.ok:
                        self.host_policy.on_insert(b.fk, self.host.slot_size_at(b.host_off), b.parent)
                        self.disk_stats.hits += 1
                        self.disk_stats.bytes_out += b.nbytes
                        self.host_stats.promotions += 1
                    else:
                        # A bad value is a miss: drop the entry everywhere, never serve it.
                        b.load_failed = True
                        self.host.free(b.host_off)  # type: ignore[arg-type]
                        b.host_off = None
                        self.disk_stats.misses += 1
                        if m.error.startswith("io"):
                            self.degraded = m.error
                            self.disk_stats.errors += 1
                        else:
                            self.disk_stats.corrupt += 1
                            bad.append(b.fk)
                        self._forget(b)
                    if ev is not None:
                        ev.set()
                self.changed.notify_all()
            if bad and self.disk is not None:
                try:
                    self.disk.delete(bad)
                except Exception as exc:  # the records are gone already; a stale value is re-verified anyway
                    log.warning("could not delete corrupt values: %s", exc)

        return self.engine.load(moves, on_done=done)

    # ---- write-back -------------------------------------------------------------------------------
    def _store(self, blocks: list[Block]) -> Job:
        """Queue host -> disk writes of dirty blocks (their slots stay pinned until done). Lock held."""
        for b in blocks:
            b.writing += 1
        moves = [Move(b.fk, self.host.view(b.host_off, b.nbytes), self.namespaces_layout(b), b.fk[:FINGERPRINT_BYTES],
                      b.fk[FINGERPRINT_BYTES:]) for b in blocks]  # type: ignore[arg-type]

        def done(job: Job) -> None:
            with self.lock:
                for b, m in zip(blocks, job.moves):
                    b.writing -= 1
                    if m.ok:  # written, even when a later batch of the job failed
                        if not b.on_disk and b.fk in self.blocks:
                            b.on_disk = True
                            b.disk_bytes = m.stored_bytes
                            self._disk_added(b)
                            self.disk_stats.bytes_in += b.nbytes
                if job.error is not None:
                    self.disk_stats.errors += 1
                    if "full" not in str(job.error):
                        self.degraded = str(job.error)
                self.changed.notify_all()
            self._kick.set()  # the evictor may be waiting on this write (demotion, write-behind)

        return self.engine.store(moves, on_done=done)

    def namespaces_layout(self, b: Block):
        ns = self.namespaces.get(b.fk[:FINGERPRINT_BYTES])
        assert ns is not None, "a host block always belongs to a registered namespace"
        return ns.layout

    def _disk_added(self, b: Block) -> None:
        self.disk_used += stored_size(b.disk_bytes)
        self.disk_stats.bytes_logical += b.nbytes
        self.disk_stats.bytes_stored += b.disk_bytes
        self.disk_policy.on_insert(b.fk, stored_size(b.disk_bytes), b.parent)

    def _disk_removed(self, b: Block) -> None:
        self.disk_used -= stored_size(b.disk_bytes)
        self.disk_stats.bytes_logical -= b.nbytes
        self.disk_stats.bytes_stored -= b.disk_bytes
        self.disk_policy.on_remove(b.fk)
        b.on_disk = False
        b.disk_bytes = 0

    def _make_disk_room(self, incoming: int) -> list[bytes]:
        """Called by the disk writer: keys to delete so ``incoming`` bytes fit under the high watermark."""
        assert self.disk is not None
        with self.lock:
            limit = self.cfg.disk.high_watermark * self.disk.capacity
            if self.disk_used + incoming <= limit:
                return []
            target = self.disk_used + incoming - self.cfg.disk.low_watermark * self.disk.capacity
            victims = self.disk_policy.victims(int(target), self._disk_protected) or \
                self.disk_policy.victims(int(self.disk_used + incoming - limit), self._disk_protected)
            if victims is None:
                raise TierFull("disk tier is full and nothing can be dropped")
            keys = []
            for fk in victims:
                b = self.blocks[fk]
                self._disk_removed(b)
                self.disk_stats.evictions += 1
                keys.append(fk)
                if b.host_off is None and b.gpu_off is None:
                    self._forget(b)
            return keys

    def _disk_protected(self, fk: bytes) -> bool:
        b = self.blocks.get(fk)
        return b is None or b.loading is not None

    # ---- host eviction ----------------------------------------------------------------------------
    def _alloc_slot(self, slot: int, wait: bool = True) -> int:
        """A host slot, evicting clean blocks (or, with ``wait``, waiting for write-back). Lock held."""
        deadline = None
        while True:
            off = self.host.alloc(slot) if self.host.used_bytes + slot <= self.host_limit else None
            if off is not None:
                if self.host.used_bytes > self.cfg.host.high_watermark * self.host_limit:
                    self._kick_evictor()
                return off
            if self._closing:
                raise TierFull("daemon is shutting down")
            victims = self.host_policy.victims(slot, self._host_protected_clean)
            if victims:
                for fk in victims:
                    self._drop_host(self.blocks[fk])
                continue
            if not wait:
                raise TierFull("host tier has no clean block to evict right now")
            if deadline is None:
                deadline = time.monotonic() + 30.0
            self._kick_evictor(force=True)
            if time.monotonic() > deadline or not self._evictable_exists():
                raise TierFull("host tier is full: every block is leased or pinned")
            self.changed.wait(0.05)

    def _make_host_room(self, nbytes: int) -> None:
        """Drop enough clean blocks for ``nbytes`` of new slots in one policy walk (a large put would
        otherwise walk once per slot); whatever this cannot free, :meth:`_alloc_slot` handles. Lock held."""
        short = self.host.used_bytes + nbytes - self.host_limit
        if short <= 0:
            return
        victims = self.host_policy.victims(short, self._host_protected_clean)
        for fk in victims or ():
            self._drop_host(self.blocks[fk])

    def _worth_writing(self, b: Block, mode: str) -> bool:
        """The admission rule of a colder tier: every block, the ones the placement rule predicts are
        read again (every one while the writer keeps up), blocks used twice / shared / pinned, or
        pinned only."""
        if mode == "predicted":
            return self.placement.wants(b.fk, time.monotonic(), sharers=b.leases, pinned=b.pin > 0,
                                        spare=self.engine.store_backlog() == 0)
        return mode == "all" or b.pin > 0 or (mode == "reused" and (b.hits >= 1 or b.leases > 0))

    def _admit(self, b: Block) -> bool:
        """Whether a host victim is worth a disk write (durable puts and the flush skip this); counted."""
        mode = self.cfg.disk.admission
        if mode != "predicted":
            ok = self._worth_writing(b, mode)
            self.placement.admitted += ok
            self.placement.rejected += not ok
            return ok
        return self.placement.admit(b.fk, time.monotonic(), sharers=b.leases, pinned=b.pin > 0,
                                    spare=self.engine.store_backlog() == 0)

    def _requested(self, s: Session, keys: list[bytes]) -> None:
        """A request uses its prefix chain ``keys`` (fetch, acquire, prefetch; a lookup is only a
        query, and clients mostly answer it from the shared index): the reuse models learn from it."""
        fks, now = [s.fp + k for k in keys], time.monotonic()
        with self.lock:
            self.host_reuse.requested(fks, now)
            if self.cfg.disk.admission == "predicted":
                self.placement.requested(fks, now)

    def request_finished(self, s: Session, keys: list[bytes]) -> int:
        """The engine finished a request whose prompt and output chain is ``keys``: a conversation tail
        its next turn may extend. Returns how many of the keys are cached."""
        fks = [s.fp + k for k in keys]
        with self.lock:
            now = time.monotonic()
            self.host_reuse.request_finished(fks, now)
            self.placement.request_finished(fks, now)
            return sum(1 for fk in fks if fk in self.blocks)

    def _host_protected_clean(self, fk: bytes) -> bool:
        """A store making room skips this block: in use, or dirty and worth writing first (write-behind
        cleans such blocks ahead, so a burst that fits the clean part of the tier does not wait)."""
        b = self.blocks[fk]
        return b.protected or (not b.on_disk and self.disk is not None and self._worth_writing(b, self.cfg.disk.admission))

    def _host_protected(self, fk: bytes) -> bool:
        return self.blocks[fk].protected

    def _evictable_exists(self) -> bool:
        """Whether waiting can help: some block is not held by a client or a pin (blocks being written
        back or loaded become evictable when their transfer ends)."""
        return self.host_policy.victims(1, self._host_held) is not None

    def _host_held(self, fk: bytes) -> bool:
        b = self.blocks[fk]
        return b.leases > 0 or b.pin > 0

    def _drop_host(self, b: Block) -> None:
        """Free a block's host slot (it stays on disk if it is there). Lock held."""
        self.host_reuse.left(b.fk, time.monotonic(), len(self.host_policy))
        self.host_policy.on_remove(b.fk)
        self.host.free(b.host_off)  # type: ignore[arg-type]
        b.host_off = None
        self.host_stats.evictions += 1
        if b.on_disk:
            self.host_stats.demotions += 1
        elif b.gpu_off is None:
            self._forget(b)
        self.changed.notify_all()

    def _forget(self, b: Block) -> None:
        """Remove a block that is in no tier any more. Lock held."""
        if b.on_disk:
            self._disk_removed(b)
        if self.blocks.get(b.fk) is b:
            del self.blocks[b.fk]
            fp = b.fk[:FINGERPRINT_BYTES]
            self.ns_blocks[fp] = self.ns_blocks.get(fp, 1) - 1

    def _write_through(self, blocks: list[Block]) -> None:
        """Copy admitted host blocks to the remote tier in the background (slots pinned meanwhile).
        Lock held."""
        if self.remote is None:
            return
        todo = [b for b in blocks if not b.on_remote and b.host_off is not None and b.loading is None
                and self._worth_writing(b, self.cfg.remote.admission)]
        if not todo:
            return
        for b in todo:
            b.writing += 1
            b.on_remote = True  # optimistic: a failed write is undone below
        moves = [Move(b.fk, self.host.view(b.host_off, b.nbytes), self.namespaces_layout(b),
                      b.fk[:FINGERPRINT_BYTES], b.fk[FINGERPRINT_BYTES:]) for b in todo]  # type: ignore[arg-type]

        def done(job: Job) -> None:
            with self.lock:
                for b, m in zip(todo, job.moves):
                    b.writing -= 1
                    if m.ok:
                        self.remote_stats.bytes_in += b.nbytes
                    else:
                        b.on_remote = False
                self.changed.notify_all()

        self.engine.store_remote(self.remote, moves, on_done=done)

    def _touch(self, b: Block) -> None:
        b.hits += 1
        if b.host_off is not None and b.loading is None and b.fk in self.host_policy:
            self.host_policy.on_access(b.fk)
        if b.on_disk:
            self.disk_policy.on_access(b.fk)

    def _kick_evictor(self, force: bool = False) -> None:
        self._force = force or self._force
        self._kick.set()

    def _evict_loop(self) -> None:
        """Demote between the watermarks: write dirty victims back, then free their slots."""
        while not self._closing:
            self._kick.wait(0.5)
            self._kick.clear()
            try:
                self._demote_once()
                if self._undrained:
                    self._retry_drains()
                self._write_behind()
            except Exception:
                log.exception("evictor")

    def _demote_once(self) -> None:
        with self.lock:
            cap = self.host_limit
            force = self._force
            self._force = False
            if self.host.used_bytes <= self.cfg.host.high_watermark * cap and not force:
                return
            want = int(self.host.used_bytes - self.cfg.host.low_watermark * cap)
            want = max(want, self.host.slab_bytes if force else 0)
            victims = self.host_policy.victims(want, self._host_protected)
            if victims is None:
                victims = []
                # take what we can: walk down until something is possible
                n = want
                while n > 0 and not victims:
                    n //= 2
                    victims = self.host_policy.victims(n, self._host_protected) or []
            dirty = []
            for fk in victims:
                b = self.blocks[fk]
                if b.on_disk or self.disk is None or not self._admit(b):
                    self._drop_host(b)
                else:
                    dirty.append(b)
            job = self._store(dirty) if dirty else None
        if job is None:
            return
        job.wait()
        with self.lock:
            for b in dirty:
                if b.host_off is not None and not b.protected and (b.on_disk or job.error is None):
                    if b.on_disk:
                        self._drop_host(b)
            self.changed.notify_all()

    def _write_behind(self) -> None:
        """Clean the coldest admitted dirty host blocks while the disk writer is idle: a later eviction
        then only frees their slots, so a burst of stores runs at memory speed instead of disk speed."""
        if self.disk is None or not self.cfg.host.write_behind or self._closing:
            return
        if self._wb_job is not None and not self._wb_job.done.is_set():
            return  # one batch at a time; its completion wakes the evictor for the next
        with self.lock:
            if self.host.used_bytes < self.cfg.host.write_behind_above * self.host_limit:
                return
            admission = self.cfg.disk.admission

            def skip(fk: bytes) -> bool:
                b = self.blocks[fk]
                return b.protected or not self._worth_writing(b, admission)

            # Walk the policy's eviction order (clean blocks included: prefix-aware policies free a
            # parent only after its children) until it holds a batch of dirty blocks.
            batch, used = self.engine.write_batch_bytes, self.host.used_bytes
            want, order = min(batch, used), None
            while order is None and want >= 4096:
                order = self.host_policy.victims(want, skip)
                if order is None:
                    want //= 2
            victims: list[bytes] = []
            while order:
                victims = [fk for fk in order if not self.blocks[fk].on_disk]
                if want >= used or sum(self.blocks[fk].nbytes for fk in victims) >= batch:
                    break
                want = min(want * 2, used)
                order = self.host_policy.victims(want, skip)
            if not victims:
                return
            self._wb_job = self._store([self.blocks[fk] for fk in victims])
            self.written_behind += len(victims)

    # ---- pinned prefixes and windows ---------------------------------------------------------------
    def pin_prefix(self, s: Session, keys: list[bytes], priority: int) -> int:
        """Keep ``keys`` in the host tier (promoting from disk) until unpinned; returns blocks pinned.

        Pins outlive the connection (frozen system prompts); the pinned share of the host tier is
        capped by ``host.max_pinned_fraction``.
        """
        if not isinstance(priority, int) or not 1 <= priority <= 100:
            raise BadRequest("priority must be an int in 1..100")
        lease_id, _offs, _tiers = self.acquire(s, keys)
        with self.lock:
            lease = s.leases[lease_id]
            cap = self.cfg.host.max_pinned_fraction * self.host_limit
            add = sum(self.host.slot_size_at(b.host_off) for b in lease.blocks if b.pin == 0)  # type: ignore
            if self.pinned_bytes + add > cap:
                self.release(s, [lease_id])
                raise TierFull(f"pinning {add} more bytes would exceed host.max_pinned_fraction "
                               f"({self.cfg.host.max_pinned_fraction:.0%} of the host tier)")
            for b in lease.blocks:
                if b.pin == 0:
                    self.pinned_bytes += self.host.slot_size_at(b.host_off)  # type: ignore[arg-type]
                b.pin = max(b.pin, priority)
            n = len(lease.blocks)
            self.release(s, [lease_id])
        return n

    def unpin(self, s: Session, keys: list[bytes]) -> int:
        """Make pinned blocks evictable again; returns blocks unpinned."""
        self._ns(s)
        n = 0
        with self.lock:
            for k in keys:
                b = self.blocks.get(s.fp + k)
                if b is not None and b.pin:
                    b.pin = 0
                    if b.host_off is not None:
                        self.pinned_bytes -= self.host.slot_size_at(b.host_off)
                    n += 1
            self.changed.notify_all()
        return n

    def window(self, s: Session, keys: list[bytes], budget: int, sinks: int, recent: int) -> int:
        """Fit a live sequence into ``budget`` host blocks: keep the first ``sinks`` and the last
        ``recent`` blocks, then the middle blocks with the most attention mass; demote the rest to disk
        (never drop them). Returns how many blocks were demoted."""
        self._ns(s)
        if min(budget, sinks, recent) < 0:
            raise BadRequest("budget, sinks and recent must be >= 0")
        with self.lock:
            seq = [self.blocks.get(s.fp + k) for k in keys]
            resident = [(i, b) for i, b in enumerate(seq) if b is not None and b.host_off is not None]
            if len(resident) <= budget:
                return 0
            n = len(keys)
            fixed = {i for i, _ in resident if i < sinks or i >= n - recent}
            middle = sorted((b.mass, -i, i) for i, b in resident if i not in fixed)
            room = max(0, budget - len(fixed))
            keep = fixed | {i for _m, _ni, i in middle[len(middle) - room:]} if room else fixed
            out = [b for i, b in resident if i not in keep and not b.protected]
            dirty = [b for b in out if not b.on_disk and self.disk is not None]
            for b in out:
                if b not in dirty:
                    self._drop_host(b)
            job = self._store(dirty) if dirty else None
        if job is not None:
            job.wait()
            with self.lock:
                for b in dirty:
                    if b.on_disk and b.host_off is not None and not b.protected:
                        self._drop_host(b)
        return len(out)

    # ---- runtime tuning ---------------------------------------------------------------------------
    def apply(self, new: Config, changed: set[str]) -> None:
        """Apply changed settings to the running tiers (``tierkv tune``). Checks everything first:
        a bad value raises ``ValueError`` and nothing changes."""
        if "host.capacity" in changed and new.host.capacity > self.host.capacity:
            raise ValueError(f"host.capacity can only shrink at run time (pool is {self.host.capacity} bytes; "
                             "restart to grow it)")
        if "disk.capacity" in changed and (self.disk is None or new.disk.capacity > self.disk.capacity
                                           and new.disk.capacity * 1.25 > self.disk.map_size):
            raise ValueError("disk.capacity cannot grow past the size the daemon started with")
        host_policy = disk_policy = None
        if changed & {"host.policy"} or any(c.startswith("policy.") for c in changed):
            host_policy = self._make_policy(new.host.policy, new, host=True)
        if changed & {"disk.policy"} or any(c.startswith("policy.") for c in changed):
            disk_policy = self._make_policy(new.disk.policy, new)
        with self.lock:
            if host_policy is not None:
                if host_policy.name == self.host_policy.name:
                    self.host_policy.update(**new.policy_settings(new.host.policy))
                else:
                    for b in self.blocks.values():
                        if b.host_off is not None and b.loading is None:
                            host_policy.on_insert(b.fk, self.host.slot_size_at(b.host_off), b.parent)
                    self.host_policy = host_policy
            if disk_policy is not None:
                if disk_policy.name == self.disk_policy.name:
                    self.disk_policy.update(**new.policy_settings(new.disk.policy))
                else:
                    for b in self.blocks.values():
                        if b.on_disk:
                            disk_policy.on_insert(b.fk, stored_size(b.disk_bytes), b.parent)
                    self.disk_policy = disk_policy
            self.cfg = new
            self.placement.update(mode=new.disk.admission)
            self.host_limit = min(self.host.capacity, new.host.capacity)
            if self.disk is not None:
                self.disk.capacity = new.disk.capacity
            self.engine.codec = new.disk.codec
            self.engine.level = new.disk.codec_level
            self.engine.budgets.set_rate("host<->disk", new.budget.host_disk or None)
            self.engine.budgets.set_rate("gpu<->host", new.budget.gpu_host or None)
            self.engine.budgets.set_rate("host<->remote", new.budget.host_remote or None)
        self._kick_evictor(force=self.host.used_bytes > new.host.high_watermark * self.host_limit)
        if self.disk is not None and self.disk_used > new.disk.high_watermark * new.disk.capacity:
            self.engine.store([])  # an empty job runs make_room: the disk shrinks to its new size

    def remote_snapshot(self) -> dict | None:
        """The remote tier's figures for ``tierkv stats`` (server memory asked at most every 5 s)."""
        if self.remote is None:
            return None
        now = time.monotonic()
        if now - self._remote_info[0] > 5.0:
            self._remote_info = (now, self.remote.server_info())
        info = self._remote_info[1] or {}
        d = self.remote.stats()
        with self.lock:
            known = sum(1 for b in self.blocks.values() if b.on_remote)
        d.update({"capacity_bytes": info.get("max_bytes", 0), "used_bytes": info.get("used_bytes", 0),
                  "blocks": known, "eviction_policy": info.get("policy", ""),
                  "bytes_logical": self.remote_stats.bytes_in, "bytes_stored": d.get("bytes_in", 0)})
        return d

    # ---- scrub ------------------------------------------------------------------------------------
    def verify(self, drop: bool = False) -> dict:
        """Decode every disk value (header, sizes, checksum); report bad ones and optionally drop them."""
        if self.disk is None:
            return {"checked": 0, "bad": [], "dropped": 0}
        from tierkv.codecs import decode_block
        from tierkv.core.layout import Layout

        bad: list[dict] = []
        checked = 0
        for lk, value in self.disk.scan():
            checked += 1
            try:
                h = read_header(value)
                if bytes(h.fingerprint) != lk[:FINGERPRINT_BYTES]:
                    raise CodecError("namespace fingerprint differs from the key's")
                decode_block(value, layout=Layout.from_dict(h.layout), fingerprint=lk[:FINGERPRINT_BYTES],
                             key=lk[FINGERPRINT_BYTES:])
            except (CodecError, ValueError) as exc:
                bad.append({"key": lk.hex(), "error": str(exc)})
        dropped = 0
        if drop and bad:
            keys = [bytes.fromhex(b["key"]) for b in bad]
            with self.lock:
                for fk in keys:
                    b = self.blocks.get(fk)
                    if b is not None and not b.protected:
                        if b.on_disk:
                            self._disk_removed(b)
                        if b.host_off is None and b.gpu_off is None:
                            self._forget(b)
                self.disk_stats.corrupt += len(keys)
            self.disk.delete(keys)
            dropped = len(keys)
        return {"checked": checked, "bad": bad, "dropped": dropped}

    # ---- shutdown ---------------------------------------------------------------------------------
    def flush(self, timeout: float) -> int:
        """Write every dirty host block to disk (a warm next start); returns blocks written."""
        if self.disk is None:
            return 0
        deadline = time.monotonic() + timeout
        with self.lock:  # GPU commits first reach host memory (the drain), then the disk
            self._retry_drains()
            while any(b.draining for b in self.blocks.values()) and time.monotonic() < deadline:
                self.changed.wait(0.05)
            dirty = [b for b in self.blocks.values() if b.host_off is not None and not b.on_disk
                     and not b.writing and b.loading is None]
            jobs = [self._store(dirty[i:i + self.cfg.disk.write_batch])
                    for i in range(0, len(dirty), self.cfg.disk.write_batch)]
        for j in jobs:
            j.wait(max(0.0, deadline - time.monotonic()))
        return sum(1 for j in jobs if j.done.is_set() and j.error is None for m in j.moves if m.ok)

    def close(self, timeout: float) -> None:
        """Stop threads, finish in-flight writes, close LMDB and the pool."""
        self._closing = True
        self._kick.set()
        self._evictor.join(5)
        self.engine.close(timeout)
        if self.remote is not None:
            self.remote.close()
        if self.disk is not None:
            self.disk.close()
        if self.gpu is not None:
            self.gpu.close()
        if self.index is not None:
            self.index.close()
        self.host.close()

    def _make_policy(self, name: str, cfg: Config, host: bool = False):
        """A tier's policy with the configured weights, sharing the table's history where it keeps one;
        the host tier's also weighs blocks by the learned chance that they come back."""
        import inspect

        kwargs = cfg.policy_settings(name)
        params = inspect.signature(policy_class(name)).parameters
        if "history" in params:
            kwargs["history"] = self.history
        if host and "reuse" in params:
            kwargs["reuse"] = self.host_reuse.predictor(time.monotonic)
        return make_policy(name, **kwargs)

    # ---- helpers ----------------------------------------------------------------------------------
    def _ns(self, s: Session) -> Namespace:
        if s.ns is None:
            raise BadRequest("no namespace on this connection: send HELLO first")
        return s.ns

    def _host_tensor(self, offset: int, nbytes: int):
        """A torch view of a host slot, sliced from one tensor over the whole pool: slots adjacent in
        the pool are then adjacent in one storage, and the copy queues merge them into one copy."""
        if self._host_t is None:
            import torch

            self._host_t = torch.from_numpy(self.host.array)
        return self._host_t[offset:offset + nbytes]

    def _tier(self, tier: object) -> str:
        """Check a tier name from the wire: "host", or "gpu" when the GPU tier is on."""
        if tier == "host":
            return "host"
        if tier == "gpu":
            if self.gpu is None:
                raise BadRequest("the GPU tier is off (start the daemon with --gpu-capacity)")
            return "gpu"
        raise BadRequest(f"tier must be 'host' or 'gpu', got {tier!r}")


def _tier_of(b: Block) -> str:
    """The fastest tier holding a ready copy of ``b`` (a block being filled counts as its source)."""
    if b.gpu_off is not None and b.gpu_loading is None:
        return "gpu"
    return "host" if b.host_off is not None else "disk"




def _ready(b: Block, ev: threading.Event | None):
    """For a copy out of ``b``'s host slot: wait until a load into that slot finished; False if it failed."""
    def ready() -> bool:
        if ev is not None:
            ev.wait(120.0)
        return not b.load_failed and b.host_off is not None and b.loading is None
    return ready

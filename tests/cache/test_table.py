"""The decisions of tierkv.cache alone: the block table, placement and windows over plain records, with
slab allocators in place of pools and no store, thread or file."""

from __future__ import annotations

import pytest

from tests.helpers import SMALL
from tierkv.cache.admission import Admission
from tierkv.cache.block import Block, Session, fetch_source, tier_of
from tierkv.cache.disk_manager import DiskManager
from tierkv.cache.gpu_manager import GpuManager
from tierkv.cache.host_manager import HostManager
from tierkv.cache.host_outflow import HostOutflow
from tierkv.cache.policy import make_policy
from tierkv.cache.reuse import ReuseModel
from tierkv.cache.table import BlockTable
from tierkv.cache.tier_changes import TierChanges
from tierkv.cache.windows import window_out
from tierkv.core.errors import BadRequest, TierFull
from tierkv.core.keys import Namespace
from tierkv.daemon.config import Config
from tierkv.tiers.disk import stored_size
from tierkv.tiers.host import SlabAllocator

NS = Namespace("cache-test", SMALL)
FP = NS.fingerprint
SLOT = SMALL.block_bytes


def _fk(i: int) -> bytes:
    return FP + i.to_bytes(8, "little")


def _key(i: int) -> bytes:
    return i.to_bytes(8, "little")


def _rec(fk: bytes, nbytes: int, parent: bytes | None = None, **state: object) -> Block:
    """A record in the given tier state, set directly: these tests start from states the managers'
    transitions reach, without running them."""
    b = Block(fk, nbytes, parent)
    for name, value in state.items():
        setattr(b, name, value)
    return b


def _cfg(admission: str = "all") -> Config:
    cfg = Config()
    cfg.disk.admission = admission
    return cfg


class _Tiers:
    """A table, a 32-slot host allocator and a disk of ``disk_cap`` bytes with their placements."""

    def __init__(self, admission: str = "all", disk_cap: int = 1 << 20) -> None:
        cfg = _cfg(admission)
        self.table = BlockTable()
        self.pool = SlabAllocator(32 * SLOT, 8 * SLOT)
        changes = TierChanges()
        self.disk = DiskManager(self.table, make_policy("lru"), cfg.disk, lambda: disk_cap, stored_size, changes)
        admission_rule = Admission(admission)
        self.host = HostManager(self.table, self.pool, make_policy("lru"), self.disk, ReuseModel(), admission_rule,
                                (cfg.host, cfg.disk), lambda: True, changes)
        self.outflow = HostOutflow(self.host, admission_rule)

    def put(self, i: int, on_disk: bool = False) -> Block:
        b = self.table.add(_rec(_fk(i), SLOT))
        self.host.assign(b, self.pool.alloc(SLOT))
        self.host.inserted(b)
        if on_disk:
            self.disk.complete_store(b, SLOT)
        return b


def test_table_counts_blocks_per_namespace_and_finds_prefixes():
    t = BlockTable()
    for i in range(3):
        t.add(_rec(_fk(i), SLOT, host_off=i * SLOT))
    assert t.ns_blocks[FP] == 3 and len(t) == 3
    keys = [_key(0), _key(1), _key(9), _key(2)]
    assert [b.fk for b in t.prefix(FP, keys)] == [_fk(0), _fk(1)]
    assert t.lookup(FP, keys) == ["host", "host"]
    assert t.lookup_count(FP, keys) == 2 and t.lookup_count(FP, [_key(0)]) == 1
    b = t.get(_fk(1))
    t.remove(Block(_fk(1), SLOT))  # another record under the same key: the table's own stays
    assert t.get(_fk(1)) is b
    t.remove(b)
    assert t.get(_fk(1)) is None and t.ns_blocks[FP] == 2


def test_namespaces_bind_once_and_are_forgotten_when_empty():
    t = BlockTable()
    a, b = Session(1), Session(2)
    t.bind(a, NS)
    t.bind(a, NS)  # the same namespace again is a no-op
    with pytest.raises(BadRequest, match="another namespace"):
        t.bind(a, Namespace("other", SMALL))
    t.bind(b, NS)
    t.add(_rec(_fk(0), SLOT, host_off=0))
    t.unbind(a)
    t.unbind(b)
    assert FP in t.namespaces, "a namespace holding blocks stays"
    t.remove(t.get(_fk(0)))
    c = Session(3)
    t.bind(c, NS)
    t.unbind(c)
    assert FP not in t.namespaces and FP not in t.ns_blocks


def test_tickets_become_leases_and_release_checks_ids():
    t = BlockTable()
    s = Session(1)
    blocks = [t.add(_rec(_fk(i), SLOT, host_off=0, leases=1)) for i in range(2)]
    ticket = t.open_ticket(s, blocks, ["host", "host"], "host")
    with pytest.raises(BadRequest, match="ticket"):
        t.take_ticket(s, ticket + 1)
    leased, tiers, tier = t.take_ticket(s, ticket)
    lease = t.hold(s, ticket, leased, tier)
    with pytest.raises(BadRequest, match="twice"):
        t.release(s, [lease.id, lease.id])
    with pytest.raises(BadRequest, match="not held"):
        t.release(s, [lease.id + 1])
    assert list(s.leases) == [lease.id], "a refused release changes nothing"
    ended = t.release(s, [lease.id])
    assert [x.blocks for x in ended] == [blocks] and not s.leases  # the tier managers end the blocks' leases
    again = [t.add(_rec(_fk(5), SLOT, host_off=0, gpu_off=0, leases=1, gpu_leases=1))]
    t.open_ticket(s, again, ["gpu"], "gpu")
    t.hold(s, 77, again, "host")
    ended = t.drop_leases(s)
    assert sorted((x.tier, x.blocks == again) for x in ended) == [("gpu", True), ("host", True)]
    assert not s.leases and not s.tickets


def test_tier_names_follow_the_copies():
    b = _rec(_fk(0), SLOT, on_disk=True)
    assert tier_of(b) == "disk"
    b.host_off = 0
    assert tier_of(b) == "host" and fetch_source(b) == "host"
    b.gpu_off, b.draining, b.loading = 0, True, object()
    assert tier_of(b) == "gpu" and fetch_source(b) == "gpu"
    b.draining = False
    assert fetch_source(b) == "disk"


def test_host_eviction_takes_clean_blocks_and_skips_dirty_and_leased_ones():
    t = _Tiers()
    clean = [t.put(i, on_disk=True) for i in range(16)]
    dirty = [t.put(16 + i) for i in range(16)]
    clean[0].leases = 1
    assert t.host.alloc_free(SLOT) is None, "the pool is full"
    assert t.host.make_room(4 * SLOT) == 4
    dropped = [b for b in clean if b.host_off is None]
    assert len(dropped) == 4 and clean[0] not in dropped, "a leased block stays"
    assert all(b.on_disk for b in dropped) and all(b.host_off is not None for b in dirty)
    assert t.host.stats.evictions == 4 and t.host.stats.demotions == 4
    assert t.host.alloc_free(SLOT) is not None


def test_demotion_drops_clean_victims_and_hands_back_dirty_ones():
    t = _Tiers()
    t.host.host_cfg.high_watermark, t.host.host_cfg.low_watermark = 0.9, 0.5
    blocks = [t.put(i, on_disk=i % 2 == 0) for i in range(32)]
    dirty = t.outflow.demotion(force=False)
    assert dirty and all(not b.on_disk and b.host_off is not None for b in dirty)
    dropped = [b for b in blocks if b.host_off is None]
    assert all(b.on_disk for b in dropped)
    assert {b.fk for b in dropped + dirty} == {b.fk for b in blocks[:16]}, "the 16 least recent, down to low"
    for b in dirty:  # the write-back finished
        t.disk.complete_store(b, SLOT)
    t.outflow.demoted(dirty)
    assert all(b.host_off is None for b in dirty)
    assert t.pool.used_bytes <= 0.5 * t.pool.capacity + SLOT


def test_a_host_victim_on_no_other_tier_is_forgotten():
    t = _Tiers(admission="pinned")
    b = t.put(0)
    t.host.drop(b)
    assert t.table.get(b.fk) is None and t.table.ns_blocks[FP] == 0


def test_disk_room_drops_the_coldest_values_and_forgets_disk_only_blocks():
    t = _Tiers(disk_cap=10 * SLOT)
    t.disk.settings.high_watermark, t.disk.settings.low_watermark = 0.9, 0.5
    blocks = []
    for i in range(8):
        b = t.table.add(_rec(_fk(i), SLOT, on_disk=True, disk_bytes=SLOT))
        t.disk.added(b)
        blocks.append(b)
    blocks[0].loading = object()  # being read: protected
    gone = t.disk.room(2 * SLOT)
    assert gone and _fk(0) not in gone
    assert all(t.table.get(fk) is None for fk in gone), "disk-only blocks leave the table"
    assert t.disk.used + 2 * SLOT <= 0.5 * 10 * SLOT + SLOT
    assert t.disk.stats.evictions == len(gone)


def test_disk_room_with_nothing_to_drop_is_tier_full():
    t = _Tiers(disk_cap=4 * SLOT)
    b = t.table.add(_rec(_fk(0), SLOT, on_disk=True, disk_bytes=4 * SLOT, loading=object()))
    t.disk.added(b)
    with pytest.raises(TierFull):
        t.disk.room(SLOT)


def test_disk_room_keeps_the_prefix_of_a_block_host_memory_holds():
    """A chain whose tail is in host memory only (written to disk later, or never) keeps its disk part
    while other blocks can go: dropped, it would leave a hole, and the host tail could never be a hit."""
    cfg, size = _cfg(), stored_size(SLOT)
    cfg.disk.high_watermark, cfg.disk.low_watermark = 0.9, 0.5
    table, pool = BlockTable(), SlabAllocator(32 * SLOT, 8 * SLOT)
    changes = TierChanges()
    disk = DiskManager(table, make_policy("attention"), cfg.disk, lambda: 12 * size, stored_size, changes)
    host = HostManager(table, pool, make_policy("attention"), disk, ReuseModel(), Admission("all"),
                       (cfg.host, cfg.disk), lambda: True, changes)
    disk.needed_above = host.holds_children
    for i in list(range(6)) + list(range(100, 104)):  # chain A's head and all of chain B on disk
        b = table.add(_rec(_fk(i), SLOT, on_disk=True, disk_bytes=SLOT, parent=_fk(i - 1) if i % 100 else None))
        disk.added(b)
    for i in (6, 7):  # chain A's tail only in host memory
        host.inserted(table.add(_rec(_fk(i), SLOT, host_off=pool.alloc(SLOT), parent=_fk(i - 1))))
    assert disk.needed(_fk(5)) and not disk.needed(_fk(4)) and not disk.needed(_fk(103))
    gone = disk.room(2 * size)
    assert gone == [_fk(i) for i in range(103, 103 - len(gone), -1)], "only chain B, from its tail"
    # with chain B gone, room is still made from chain A's tail (a hole rather than a failed write)
    for i in range(100, 104):
        b = table.get(_fk(i))
        if b is not None:
            disk.forget(b)
    assert disk.room(5 * size)[0] == _fk(5)


def test_gpu_slots_drop_clean_copies_but_never_a_draining_one():
    table = BlockTable()
    pool = SlabAllocator(2 * SLOT, 2 * SLOT)
    changes = TierChanges()
    disk = DiskManager(table, make_policy("lru"), _cfg().disk, lambda: 0, stored_size, changes)
    gpu = GpuManager(table, pool, make_policy("lru"), disk, changes)
    only = table.add(_rec(_fk(0), SLOT, gpu_off=gpu.alloc(SLOT), draining=True))
    clean = table.add(_rec(_fk(1), SLOT, gpu_off=gpu.alloc(SLOT), host_off=0))
    gpu.inserted(only)
    gpu.inserted(clean)
    assert gpu.draining()
    assert gpu.alloc(SLOT) is not None, "the clean copy makes room"
    assert clean.gpu_off is None and table.get(clean.fk) is clean, "it stays in the host tier"
    assert gpu.alloc(SLOT) is None, "the draining block is the only copy: never dropped"


def test_window_keeps_sinks_recent_and_the_heaviest_middle():
    seq = [_rec(_fk(i), SLOT, host_off=i * SLOT, mass=m) for i, m in enumerate([1, 0.1, 5, 0.2, 3, 1, 1])]
    seq[3].leases = 1  # in use: never demoted
    out = window_out(list(seq) + [None], budget=5, sinks=1, recent=3)
    assert out == [seq[1]], "block 3 is the lightest but leased; block 1 goes"
    assert window_out(seq, budget=7, sinks=0, recent=0) == []

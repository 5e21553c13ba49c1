"""The block table in-process: host, disk and GPU stand-in tiers in a tmp dir, no daemon process.

Each test drives the table's state machine directly (store, dedup, lookup, leases, eviction, drains)
and checks the records and the bytes in the slots.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.helpers import SMALL
from tierkv.cache.block import Session
from tierkv.core.errors import BadRequest, TierFull
from tierkv.core.keys import Namespace
from tierkv.daemon.blockstore import BlockStore
from tierkv.daemon.config import Config
from tierkv.daemon.sessions import namespace

NS = Namespace("table-test", SMALL)
BLOCK = SMALL.block_bytes


def _config(tmp_path, gpu: bool = False, **host) -> Config:
    cfg = Config()
    cfg.server.data_dir = str(tmp_path)
    cfg.server.lookup_index_slots = 0
    cfg.host.capacity = host.get("capacity", 16 << 20)
    cfg.host.slab_bytes = 1 << 20
    cfg.host.prefault = False
    cfg.host.write_behind = False
    cfg.host.high_watermark = 1.0  # the evictor stays idle: each test decides when blocks move
    cfg.disk.admission = "all"
    cfg.disk.capacity = 64 << 20
    cfg.disk.sync = False
    if gpu:
        cfg.gpu.capacity = 2 << 20
        cfg.gpu.slab_bytes = 1 << 20
        cfg.gpu.device = "cpu"
    return cfg


def _alloc(t: BlockStore, s: Session, n: int, keys: list[bytes] | None = None, tier: str = "host") -> list:
    """ALLOC as its handler makes it: slots of ``tier`` for ``n`` new blocks."""
    if t.slots.tier(tier) == "gpu":
        return t.gpu_path.alloc(s, namespace(s), n, keys)
    return t.store_path.alloc(s, namespace(s), n, keys)


def _commit(t: BlockStore, s: Session, keys: list[bytes], offs: list, durable: bool = False,
            tier: str = "host") -> int:
    """COMMIT as its handler makes it (waiting for durable writes; no chains, remote copy or tokens)."""
    if t.slots.tier(tier) == "gpu":
        return t.gpu_path.commit(s, namespace(s), keys, offs, durable)
    return t.store_path.commit(s, namespace(s), keys, offs, durable, True, None, False, None)


def _acquire(t: BlockStore, s: Session, keys: list[bytes], tier: str = "host") -> tuple[int, list[int], list[str]]:
    """ACQUIRE as its handler makes it: a fetch in ``tier``, waited for without a timeout."""
    if t.slots.tier(tier) == "gpu":
        return t.fetch_path.wait(s, t.gpu_path.fetch(s, namespace(s), keys), None)
    return t.fetch_path.acquire(s, namespace(s), keys)


@pytest.fixture
def make_table(tmp_path):
    made: list[BlockStore] = []

    def make(gpu: bool = False, d=None, **host) -> BlockStore:
        d = d or tmp_path / f"t{len(made)}"
        d.mkdir(exist_ok=True)
        t = BlockStore(_config(d, gpu, **host), str(d))
        made.append(t)
        return t

    yield make
    for t in made:
        if not t.ctx.closing:  # a test may have closed it already (a restart)
            t.close(5.0)


def _session(t: BlockStore, sid: int = 1) -> Session:
    s = Session(sid)
    t.sessions.register(s, NS)
    return s


def _keys(n: int, start: int = 0) -> list[bytes]:
    return [i.to_bytes(8, "little") for i in range(start, start + n)]


def _put(t: BlockStore, s: Session, keys: list[bytes], seed: int = 0, durable: bool = False) -> list[bytes]:
    """Store one block per key through alloc/commit; returns each block's bytes."""
    offs = _alloc(t, s, len(keys), keys)
    data = [_fill(t.host.view(off, BLOCK), seed + i) for i, off in enumerate(offs)]
    _commit(t, s, keys, offs, durable=durable)
    return data


def _get(t: BlockStore, s: Session, keys: list[bytes], tier: str = "host") -> tuple[list[bytes], list[str]]:
    """Lease ``keys``, read their bytes and release; returns (bytes, source tiers)."""
    lease, offs, tiers = _acquire(t, s, keys, tier)
    pool = t.gpu if tier == "gpu" else t.host
    got = [bytes(pool.view(off, BLOCK).numpy() if tier == "gpu" else pool.view(off, BLOCK)) for off in offs]
    t.sessions.release(s, [lease])
    return got, tiers


def _fill_gpu(t: BlockStore, s: Session, keys: list[bytes]) -> tuple[list[int], list[bytes]]:
    """GPU slots for ``keys``, each filled with its seeded bytes (not committed); returns (slots, bytes)."""
    offs = _alloc(t, s, len(keys), keys, "gpu")
    return offs, [_fill(t.gpu.view(off, BLOCK), i) for i, off in enumerate(offs)]


def _fill(view, seed: int) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)
    if hasattr(view, "numpy"):
        view = view.numpy()
    view[:] = data
    return data.tobytes()


class _HeldCopies:
    """Holds the engine's GPU -> host copies until :meth:`run`, so a drain stays in flight."""

    def __init__(self, table: BlockStore) -> None:
        self.table, self.held = table, []
        self.real = table.engine.submit

        def hold(route, moves, on_done=None, **kw):
            if route != ("gpu", "host"):
                return self.real(route, moves, on_done, **kw)
            self.held.append((route, moves, on_done))
            return None

        table.engine.submit = hold

    def run(self) -> None:
        self.table.engine.submit = self.real
        for route, copies, done in self.held:
            self.real(route, copies, done).done.wait(10)
        self.held.clear()


def test_fetch_names_the_gpu_for_a_block_still_draining_from_it(make_table):
    t = make_table(gpu=True)
    s = _session(t)
    keys = _keys(2)
    held = _HeldCopies(t)
    offs, data = _fill_gpu(t, s, keys)
    assert _commit(t, s, keys, offs, tier="gpu") == 2
    assert all(t.table.get(s.fp + k).draining for k in keys)
    ticket = t.fetch_path.fetch(s, namespace(s), keys)
    held.run()
    lease, slots, tiers = t.fetch_path.wait(s, ticket, 10.0)
    assert tiers == ["gpu", "gpu"], "a draining block is served from the GPU, not the disk"
    assert [t.host.view(off, BLOCK).tobytes() for off in slots] == data
    t.sessions.release(s, [lease])


def test_host_lease_waits_for_a_gpu_commit_whose_drain_found_no_host_slot(make_table):
    t = make_table(gpu=True, capacity=2 << 20)
    s = _session(t)
    t.evictor.drains = None  # only the lease may drain the blocks
    fill = _keys(t.host.capacity // BLOCK, start=1000)
    _put(t, s, fill)
    held, _, _ = t.fetch_path.acquire(s, namespace(s), fill)  # every host slot leased: the drain below finds none
    keys = _keys(4)
    offs, data = _fill_gpu(t, s, keys)
    assert _commit(t, s, keys, offs, tier="gpu") == 4
    assert all(t.table.get(s.fp + k).draining and t.table.get(s.fp + k).host_off is None for k in keys)
    t.sessions.release(s, [held])
    got, tiers = _get(t, s, keys)
    assert tiers == ["gpu"] * 4, "the lease copies the waiting blocks down instead of ending the prefix"
    assert got == data
    blocks = [t.table.get(s.fp + k) for k in keys]
    assert not any(b.draining for b in blocks)
    slots = [b.host_off for b in blocks]
    t.evictor.drains = t.gpu_path
    t.gpu_path.retry_drains()  # the queued drains are done already: no second host copy
    assert [b.host_off for b in blocks] == slots
    assert _get(t, s, keys)[0] == data


def test_a_gpu_slot_waits_for_drains_up_to_slot_wait_s_and_wakes_when_they_end(make_table):
    import threading

    t = make_table(gpu=True)
    s = _session(t)
    held = _HeldCopies(t)
    keys = _keys(t.gpu.capacity // BLOCK)
    offs, _data = _fill_gpu(t, s, keys)
    _commit(t, s, keys, offs, tier="gpu")  # every GPU slot is the only copy of a block until its drain ends
    t.ctx.cfg.server.slot_wait_s = 0.3
    t0 = time.monotonic()
    with pytest.raises(TierFull):
        _alloc(t, s, 1, tier="gpu")
    assert 0.3 <= time.monotonic() - t0 < 5.0, "the wait ends at server.slot_wait_s"
    t.ctx.cfg.server.slot_wait_s = 60.0
    drains = threading.Timer(0.3, held.run)
    drains.start()
    t0 = time.monotonic()
    assert _alloc(t, s, 1, tier="gpu") != [None]
    assert time.monotonic() - t0 < 10.0, "a drain's completion wakes the waiting request"
    drains.join()


def test_a_slot_wait_ends_when_the_store_closes(make_table):
    import threading

    t = make_table(gpu=True)
    s = _session(t)
    _HeldCopies(t)  # the drains never finish
    keys = _keys(t.gpu.capacity // BLOCK)
    offs, _data = _fill_gpu(t, s, keys)
    _commit(t, s, keys, offs, tier="gpu")
    t.ctx.cfg.server.slot_wait_s = 60.0
    raised: list[BaseException] = []

    def alloc() -> None:
        try:
            _alloc(t, s, 1, tier="gpu")
        except TierFull as exc:
            raised.append(exc)

    waiter = threading.Thread(target=alloc)
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive(), "the request waits for a drain"
    t0 = time.monotonic()
    t.close(5.0)
    waiter.join(10.0)
    assert not waiter.is_alive() and len(raised) == 1 and time.monotonic() - t0 < 10.0


def test_a_host_slot_waits_for_the_writer_and_never_drops_a_block_it_can_write(make_table):
    t = make_table(capacity=1 << 20)
    t.ctx.cfg.server.slot_wait_s = 60.0
    s = _session(t)
    _put(t, s, _keys(t.host.capacity // BLOCK))  # dirty: each worth writing before it may leave
    t0 = time.monotonic()
    assert _alloc(t, s, 1) != [None]
    assert time.monotonic() - t0 < 10.0, "the write's completion wakes the waiting request"
    assert t.hostm.stats.dropped_unwritten == 0


@pytest.mark.parametrize("idle", [True, False])
def test_demotions_encode_on_the_idle_class_threads_unless_told_not_to(make_table, idle):
    """``disk.demote_idle`` (with ``disk.write_behind_idle``, the default): the blocks the evictor
    demotes (write-behind off here) are encoded by the threads in Linux's idle class, not by the niced
    ones durable puts use (a pool starts its threads on its first job); either way they land on disk."""
    import threading

    t = make_table(capacity=1 << 20)
    t.ctx.cfg.disk.demote_idle = idle
    t.ctx.cfg.host.high_watermark, t.ctx.cfg.host.low_watermark = 0.5, 0.25
    s = _session(t)
    keys = _keys(t.host.capacity // BLOCK // 2 + 8)
    before = set(threading.enumerate())
    _put(t, s, keys)
    t.ctx.kick()
    records = [t.table.get(s.fp + k) for k in keys]
    deadline = time.monotonic() + 30
    while sum(b.on_disk for b in records) < len(keys) // 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sum(b.on_disk for b in records) >= len(keys) // 4 and t.hostm.stats.dropped_unwritten == 0
    names = {th.name.rsplit("_", 1)[0] for th in set(threading.enumerate()) - before}
    assert ("tierkv-encode-bg" in names, "tierkv-encode" in names) == (idle, not idle)


def test_tune_keeps_the_disk_policy_weighted_by_the_admission_model(make_table):
    import dataclasses

    t = make_table()  # admission "all": the disk policy has no reuse factor
    pol = t.diskm.policy
    assert pol.reuse is None
    for mode, weighted in (("predicted", True), ("all", False), ("predicted", True)):
        new = dataclasses.replace(t.ctx.cfg, disk=dataclasses.replace(t.ctx.cfg.disk, admission=mode))
        t.tuner.apply(new, {"disk.admission"})
        assert t.diskm.policy is pol and (pol.reuse is not None) == weighted
    new = dataclasses.replace(t.ctx.cfg, policy={**t.ctx.cfg.policy, "beta": 0.7})
    t.tuner.apply(new, {"policy.beta"})  # a weight changed: the policy keeps its reuse factor
    assert pol.settings()["beta"] == 0.7 and pol.reuse is not None
    rule = t.admission  # make its two models disagree: a return past the eviction model's shorter list
    rule.update(ghost_entries=100, evict_horizon=0.5)
    now = time.monotonic()
    rule.requested([b"late"], now)
    rule.admit(b"late", now)
    for i in range(70):
        rule.requested([i], now)
        rule.admit(i, now)
    rule.requested([b"late"], now)
    rule.requested([b"like late"], now)  # a block of the class late left in
    assert rule.model.p(b"like late", now) > 0.5 > rule.evict_model.p(b"like late", now)
    assert pol.reuse(b"like late") == rule.evict_model.p(b"like late", now)  # the order's model


def test_disk_policy_ages_by_idle_time_and_tune_changes_it(make_table):
    import dataclasses

    t = make_table()
    pol = t.diskm.policy
    assert pol.settings()["idle_aging"] == t.ctx.cfg.disk.idle_aging == 0.5 and pol.tau > 0
    assert t.hostm.policy.settings()["idle_aging"] == 0.0  # the host keeps the GDSF aging clock
    for scale in (1.5, 0.0):
        new = dataclasses.replace(t.ctx.cfg, disk=dataclasses.replace(t.ctx.cfg.disk, idle_aging=scale))
        t.tuner.apply(new, {"disk.idle_aging"})
        assert t.diskm.policy is pol and pol.settings()["idle_aging"] == scale
    assert pol.tau == 0.0


def test_store_lookup_and_dedup(make_table):
    t = make_table()
    s = _session(t)
    keys = _keys(3)
    data = _put(t, s, keys)
    assert t.fetch_path.lookup(s.fp, keys) == ["host"] * 3
    assert t.fetch_path.lookup(s.fp, [keys[0], keys[1], b"missing", keys[2]]) == ["host", "host"]
    assert t.fetch_path.lookup_count(s, keys + [b"missing"]) == 3
    used = t.host.used_bytes
    assert _alloc(t, s, 3, keys) == [None, None, None], "cached keys get no slot"
    offs = _alloc(t, s, 3)
    assert _commit(t, s, keys, offs) == 0, "the same keys again are deduplicated"
    assert t.host.used_bytes == used, "deduplicated slots go back to the pool"
    assert _get(t, s, keys) == (data, ["host"] * 3)


def test_namespaces_are_apart_and_forgotten_when_empty(make_table):
    t = make_table()
    a, b = _session(t, 1), Session(2)
    t.sessions.register(b, Namespace("other-model", SMALL))
    _put(t, a, _keys(2))
    assert t.fetch_path.lookup(b.fp, _keys(2)) == [], "another namespace never sees these blocks"
    assert len(t.table.namespaces) == 2
    t.sessions.close(b)
    assert list(t.table.namespaces) == [a.fp], "a namespace with no block and no connection is forgotten"


def test_leases_pin_blocks_against_eviction_and_evicted_blocks_come_back_from_disk(make_table):
    t = make_table(capacity=1 << 20)
    s = _session(t)
    per = t.host.capacity // BLOCK
    first = _keys(per)
    data = _put(t, s, first, durable=True)  # on disk too: clean, so a new store may evict them
    lease, offs, _ = t.fetch_path.acquire(s, namespace(s), first[:8])
    _put(t, s, _keys(per // 2, start=per), seed=1000)
    records = [t.table.get(s.fp + k) for k in first]
    assert all(b.host_off is not None for b in records[:8]), "leased blocks stay in host memory"
    assert [bytes(t.host.view(off, BLOCK)) for off in offs] == data[:8]
    evicted = [i for i, b in enumerate(records) if b.host_off is None]
    assert len(evicted) >= per // 2 and all(records[i].on_disk for i in evicted)
    t.sessions.release(s, [lease])
    i = evicted[0]
    assert t.fetch_path.lookup(s.fp, [first[i]]) == ["disk"]
    assert _get(t, s, [first[i]]) == ([data[i]], ["disk"])
    assert t.hostm.stats.evictions >= per // 2 and t.diskm.stats.hits == 1


def test_a_full_host_tier_of_leased_blocks_is_tier_full(make_table):
    t = make_table(capacity=1 << 20)
    s = _session(t)
    per = t.host.capacity // BLOCK
    keys = _keys(per)
    _put(t, s, keys, durable=True)
    lease, _offs, _tiers = t.fetch_path.acquire(s, namespace(s), keys)
    with pytest.raises(TierFull):
        _alloc(t, s, 1)
    t.sessions.release(s, [lease])
    assert _alloc(t, s, 1) != [None], "released blocks are evictable again"


def test_records_survive_a_restart_from_disk(make_table, tmp_path):
    d = tmp_path / "same"
    t = make_table(d=d)
    s = _session(t)
    keys = _keys(4)
    data = _put(t, s, keys, durable=True)
    t.close(5.0)
    t2 = make_table(d=d)
    s2 = _session(t2)
    assert t2.fetch_path.lookup(s2.fp, keys) == ["disk"] * 4
    assert _get(t2, s2, keys) == (data, ["disk"] * 4)


def test_gpu_commit_drains_to_host_and_stays_busy_until_then(make_table):
    t = make_table(gpu=True)
    s = _session(t)
    keys = _keys(3)
    held = _HeldCopies(t)
    offs, data = _fill_gpu(t, s, keys)
    _commit(t, s, keys, offs, tier="gpu")
    b = t.table.get(s.fp + keys[0])
    assert b.draining and b.gpu_protected and b.host_off is not None and b.loading is not None
    assert t.fetch_path.lookup(s.fp, keys) == ["gpu"] * 3
    assert t.retention.delete(s, keys) == 0, "a block whose only copy is on the GPU is never deleted"
    held.run()
    assert not b.draining and b.host_ready
    assert [bytes(t.host.view(t.table.get(s.fp + k).host_off, BLOCK)) for k in keys] == data
    assert t.gpum.stats.demotions == 3
    assert t.retention.delete(s, keys) == 3 and t.fetch_path.lookup(s.fp, keys) == []


def test_gpu_fetch_promotes_host_blocks(make_table):
    t = make_table(gpu=True)
    s = _session(t)
    keys = _keys(2)
    data = _put(t, s, keys)
    assert _get(t, s, keys, "gpu") == (data, ["host", "host"])
    assert t.fetch_path.lookup(s.fp, keys) == ["gpu", "gpu"]
    assert t.gpum.stats.promotions == 2


def test_misuse_is_a_bad_request_and_changes_nothing(make_table):
    t = make_table()
    s = Session(1)
    with pytest.raises(BadRequest, match="HELLO"):
        _alloc(t, s, 1)
    t.sessions.register(s, NS)
    with pytest.raises(BadRequest, match="another namespace"):
        t.sessions.register(s, Namespace("other-model", SMALL))
    with pytest.raises(BadRequest, match="not allocated"):
        _commit(t, s, _keys(1), [0])
    with pytest.raises(BadRequest, match="disagree"):
        _alloc(t, s, 2, _keys(1))
    with pytest.raises(BadRequest, match="GPU tier is off"):
        _alloc(t, s, 1, tier="gpu")
    with pytest.raises(BadRequest, match="tier must be"):
        _acquire(t, s, _keys(1), tier="disk")
    with pytest.raises(BadRequest, match="ticket"):
        t.fetch_path.wait(s, 99, 0)
    _put(t, s, _keys(1))
    lease, _offs, _tiers = t.fetch_path.acquire(s, namespace(s), _keys(1))
    with pytest.raises(BadRequest, match="twice"):
        t.sessions.release(s, [lease, lease])
    t.sessions.release(s, [lease])
    with pytest.raises(BadRequest, match="not held"):
        t.sessions.release(s, [lease])
    assert t.table.get(s.fp + _keys(1)[0]).leases == 0


def test_closing_a_connection_frees_its_slots_and_leases(make_table):
    t = make_table()
    s = _session(t)
    keys = _keys(2)
    _put(t, s, keys)
    used = t.host.used_bytes
    _alloc(t, s, 4)
    t.fetch_path.acquire(s, namespace(s), keys)
    t.fetch_path.fetch(s, namespace(s), keys)
    t.sessions.close(s)
    assert t.host.used_bytes == used
    assert all(t.table.get(s.fp + k).leases == 0 for k in keys)


def test_window_demotes_the_middle_with_the_least_attention(make_table):
    t = make_table()
    s = _session(t)
    keys = _keys(6)
    _put(t, s, keys)
    t.signals.touch(s, keys, [1.0, 0.1, 5.0, 0.2, 1.0, 1.0])
    assert t.retention.window(s, keys, budget=4, sinks=1, recent=2) == 2
    assert t.fetch_path.lookup(s.fp, keys) == ["host", "disk", "host", "disk", "host", "host"]

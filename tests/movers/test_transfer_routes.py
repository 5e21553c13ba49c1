"""The transfer engine's seams: jobs routed by (source, destination) tier, the disk writer reporting a full
map as a result and deleting only what the daemon chose, and verify as a mover job; and the block store
making room on disk itself (the deletes ride with its store jobs)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import SMALL
from tierkv.cache.block import Session
from tierkv.codecs import decode_block
from tierkv.core.errors import TierFull
from tierkv.core.keys import Namespace
from tierkv.core.layout import Layout
from tierkv.daemon.blockstore import BlockStore
from tierkv.daemon.config import Config
from tierkv.daemon.sessions import namespace
from tierkv.movers.engine import VERIFY, Move, TransferEngine
from tierkv.tiers.disk import DiskTier

LAYOUT = Layout(2, 2, 32, 16, "bfloat16")  # 8 KiB blocks
BIG = Layout(2, 4, 64, 256, "bfloat16")    # 512 KiB blocks
FP = b"\x02" * 16
TO_DISK, FROM_DISK = ("host", "disk"), ("disk", "host")


def _moves(n: int, seed: int, layout: Layout = LAYOUT) -> list[Move]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        key = b"route-%d-%d" % (seed, i)
        out.append(Move(FP + key, rng.integers(0, 255, layout.block_bytes, dtype=np.uint8), layout, FP, key))
    return out


def _stored(disk: DiskTier) -> set[bytes]:
    return {bytes(k) for k, _ in disk.scan()}


@pytest.fixture
def engine(tmp_path: Path):
    tier = DiskTier(tmp_path / "disk", 64 << 20, sync=False)
    eng = TransferEngine(tier, workers=2, codec="raw")
    yield eng
    eng.close()
    tier.close()


def test_submit_routes_by_source_and_destination(engine: TransferEngine) -> None:
    assert engine.routes == [("disk", "host"), VERIFY, TO_DISK]
    out = _moves(3, 1)
    stored = engine.submit(TO_DISK, out)
    assert stored.wait(10) and stored.route == TO_DISK and all(m.ok for m in out)
    back = [Move(m.lmdb_key, np.zeros_like(m.view), LAYOUT, FP, m.key) for m in out]
    seen: list = []
    loaded = engine.submit(FROM_DISK, back, on_done=seen.append)
    assert loaded.wait(10) and all(m.ok for m in back) and seen == [loaded]
    assert [m.view.tobytes() for m in back] == [m.view.tobytes() for m in out]
    assert engine.book.link_bytes["host->disk"] == engine.book.link_bytes["disk->host"] == 3 * LAYOUT.block_bytes


def test_an_unknown_route_is_refused_with_the_routes_served(engine: TransferEngine) -> None:
    with pytest.raises(ValueError, match=r"no mover serves the route host->gpu \(served: disk->host, "
                                         r"disk->verify, host->disk\)"):
        engine.submit(("host", "gpu"), [])
    with pytest.raises(ValueError, match="only host->disk jobs delete"):
        engine.submit(FROM_DISK, [], deletes=[b"x"])
    assert engine.book.inflight == 0  # nothing was opened
    no_disk = TransferEngine(None)
    try:
        with pytest.raises(ValueError, match=r"served: none"):
            no_disk.submit(TO_DISK, [])
    finally:
        no_disk.close()


def test_a_store_deletes_exactly_what_it_carries_in_its_transaction(engine: TransferEngine) -> None:
    first = _moves(4, 2)
    assert engine.submit(TO_DISK, first).wait(10)
    doomed = [first[0].lmdb_key, first[2].lmdb_key]
    before = engine.disk.env.info()["last_txnid"]
    second = _moves(2, 3)
    job = engine.submit(TO_DISK, second, deletes=doomed)
    assert job.wait(10) and job.error is None and all(m.ok for m in second)
    assert engine.disk.env.info()["last_txnid"] - before == 1  # puts and deletes in one transaction
    assert _stored(engine.disk) == {first[1].lmdb_key, first[3].lmdb_key} | {m.lmdb_key for m in second}
    only = engine.submit(TO_DISK, [], deletes=[first[1].lmdb_key])  # a job that only deletes
    assert only.wait(10) and only.error is None
    assert first[1].lmdb_key not in _stored(engine.disk)


def test_a_full_map_comes_back_as_the_jobs_result(tmp_path: Path) -> None:
    """A 1 MiB tier has a ~65 MiB map: 80 MiB in one job fills it. The job reports it (``full``); the
    writer deletes nothing on its own, and writes resume once the caller's deletes freed pages."""
    tier = DiskTier(tmp_path / "disk", 1 << 20, sync=False)
    eng = TransferEngine(tier, workers=2, codec="raw")
    try:
        moves = _moves(160, 4, BIG)
        job = eng.submit(TO_DISK, moves)
        assert job.wait(60)
        assert job.full and isinstance(job.error, TierFull) and "map" in str(job.error)
        written = [m.lmdb_key for m in moves if m.ok]
        assert written and len(written) < len(moves)
        assert _stored(tier) == set(written)  # the writer kept every value it wrote
        again = _moves(2, 5, BIG)
        assert eng.submit(TO_DISK, again).wait(10) and not any(m.ok for m in again)
        # the caller's choice of what goes, in transactions of their own (LMDB reuses the pages a
        # transaction freed from the second committed transaction after it on)
        for part in (written[::2], written[1::2]):
            freed = eng.submit(TO_DISK, [], deletes=part)
            assert freed.wait(10) and freed.error is None and not freed.full
        resumed = eng.submit(TO_DISK, again)
        assert resumed.wait(10) and resumed.error is None and all(m.ok for m in again)
        assert _stored(tier) == {m.lmdb_key for m in again}
    finally:
        eng.close()
        tier.close()


def test_verify_is_a_mover_job_that_reports_and_deletes_nothing(engine: TransferEngine) -> None:
    good = _moves(3, 6)
    assert engine.submit(TO_DISK, good).wait(10)
    blob = engine.disk.read(good[1].lmdb_key, bytes)
    bad = bytearray(blob)
    bad[-1] ^= 0xFF  # payload flipped: the header reads, the checksum fails
    engine.disk.write([(good[1].lmdb_key, bytes(bad)), (FP + b"junk", b"not a block")])
    seen: list[str] = []
    job = engine.submit(VERIFY, [], on_done=lambda j: seen.append(threading.current_thread().name))
    assert job.wait(30) and job.error is None and job.route == VERIFY
    assert job.checked == 4
    assert sorted(k for k, _ in job.bad) == sorted([good[1].lmdb_key, FP + b"junk"])
    assert all(why for _, why in job.bad)
    assert seen[0].startswith("tierkv-decode")
    assert len(_stored(engine.disk)) == 4  # dropping is the daemon's decision
    got = engine.disk.read(good[0].lmdb_key, lambda v: decode_block(v, layout=LAYOUT, fingerprint=FP, key=good[0].key))
    assert bytes(np.asarray(got).view(np.uint8)) == good[0].view.tobytes()


# ---- the daemon side: the store's own room decisions ---------------------------------------------------
def test_the_store_chooses_the_deletes_its_disk_writes_carry(tmp_path: Path) -> None:
    cfg = Config()
    cfg.server.data_dir = str(tmp_path)
    cfg.server.lookup_index_slots = 0
    cfg.host.capacity, cfg.host.slab_bytes, cfg.host.prefault = 16 << 20, 1 << 20, False
    cfg.host.write_behind, cfg.host.high_watermark = False, 1.0
    cfg.disk.admission, cfg.disk.sync, cfg.disk.codec = "all", False, "raw"
    cfg.disk.capacity = 40 * (SMALL.block_bytes + 8192)  # about 40 raw blocks
    st = BlockStore(cfg, str(tmp_path))
    submitted: list[tuple[tuple[str, str], list[bytes]]] = []
    real = st.engine.submit

    def record(route, moves, on_done=None, **kw):  # what the store hands the movers
        submitted.append((route, list(kw.get("deletes", ()))))
        return real(route, moves, on_done, **kw)

    st.engine.submit = record  # type: ignore[method-assign]
    try:
        s = Session(1)
        st.sessions.register(s, Namespace("routes", SMALL))
        rng = np.random.default_rng(7)
        for i in range(8):
            keys = [b"%08d" % (i * 8 + j) for j in range(8)]
            offs = st.store_path.alloc(s, namespace(s), 8, keys)
            for off in offs:
                st.host.view(off, SMALL.block_bytes)[:] = rng.integers(0, 255, SMALL.block_bytes, dtype=np.uint8)
            st.store_path.commit(s, namespace(s), keys, offs, True, True, None, False, None)
        deletes = [k for route, d in submitted if route == TO_DISK for k in d]
        assert deletes, "the disk filled up, yet no store job carried deletes"
        with st.ctx.lock:
            assert not any(st.table.get(fk) is not None and st.table.get(fk).on_disk for fk in deletes)
            assert st.diskm.reserved == 0 and st.diskm.used <= cfg.disk.high_watermark * cfg.disk.capacity
            on_disk = {b.fk for b in st.table.records() if b.on_disk}
        assert st.disk is not None and _stored(st.disk) == on_disk
        assert st.transfers.verify() == {"checked": len(on_disk), "bad": [], "dropped": 0}
        assert (VERIFY, []) in submitted  # the store's verify is a mover job
    finally:
        st.close(5.0)


@pytest.mark.parametrize("idle", [False, True])
def test_disk_writes_run_below_the_engine(tmp_path: Path, idle: bool) -> None:
    """The threads that encode and write blocks to disk run niced, or in the idle scheduling class; the
    threads that load keep the daemon's priority. A write still lands."""
    import os

    tier = DiskTier(tmp_path / "disk", 64 << 20, sync=False)
    eng = TransferEngine(tier, workers=2, codec="lossless", write_nice=7, write_idle=idle)
    try:
        out = _moves(4, 9)
        assert eng.submit(TO_DISK, out).wait(10) and all(m.ok for m in out)
        back = [Move(m.lmdb_key, np.zeros_like(m.view), LAYOUT, FP, m.key) for m in out]
        assert eng.submit(FROM_DISK, back).wait(10) and all(m.ok for m in back)
        seen: dict[str, set[tuple[int, int]]] = {}
        for t in threading.enumerate():
            if t.name.startswith(("tierkv-encode", "tierkv-disk-writer", "tierkv-decode")) and t.native_id:
                seen.setdefault(t.name.split("_")[0], set()).add(
                    (os.sched_getscheduler(t.native_id), os.getpriority(os.PRIO_PROCESS, t.native_id)))
        base = os.getpriority(os.PRIO_PROCESS, 0)
        writers = seen["tierkv-encode"] | seen["tierkv-disk-writer"]
        if idle:
            assert {policy for policy, _ in writers} == {os.SCHED_IDLE}
        else:
            assert writers == {(os.SCHED_OTHER, min(19, base + 7))}
        assert seen["tierkv-decode"] == {(os.SCHED_OTHER, base)}
    finally:
        eng.close()
        tier.close()

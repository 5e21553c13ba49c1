"""The disk writer on a real LMDB tier: store jobs queued behind each other share a transaction, a failure
fails every job of that transaction and nothing of it is counted, blocks of a batch that committed before
a later batch failed are counted, the commit's writeback kick, and the chunks of a streamed durable put."""

from __future__ import annotations

import errno
import time
from pathlib import Path

import numpy as np
import pytest

import tierkv.client.durable
from tierkv.client.durable import durable_chunks as _durable_chunks
from tierkv.codecs import decode_block
from tierkv.core.layout import Layout
from tierkv.movers.engine import Job, Move, TransferEngine
from tierkv.tiers.disk import DiskTier

LAYOUT = Layout(2, 2, 32, 16, "bfloat16")  # 8 KiB blocks
FP = b"\x01" * 16
TO_DISK = ("host", "disk")


def _moves(n: int, seed: int) -> list[Move]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        key = b"blk-%d-%d" % (seed, i)
        view = rng.integers(0, 255, LAYOUT.block_bytes, dtype=np.uint8)
        out.append(Move(FP + key, view, LAYOUT, FP, key))
    return out


def _txnid(tier: DiskTier) -> int:
    return tier.env.info()["last_txnid"]


def _wait_dequeued(engine: TransferEngine) -> None:
    deadline = time.monotonic() + 10
    while engine.store_backlog() and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.05)  # the writer is now inside disk.write, waiting for the lock the test holds


@pytest.fixture
def engine(tmp_path: Path):
    tier = DiskTier(tmp_path / "disk", 64 << 20)
    eng = TransferEngine(tier, workers=2, codec="raw")
    yield eng
    eng.close()
    tier.close()


def _stalled_then_queued(engine: TransferEngine, groups: list[list[Move]]) -> list[Job]:
    """The first group's job is taken by the writer and held at the disk's lock; the rest queue behind."""
    disk = engine.disk
    assert disk is not None
    with disk._write_lock:
        jobs = [engine.submit(TO_DISK, groups[0])]
        _wait_dequeued(engine)
        jobs += [engine.submit(TO_DISK, g) for g in groups[1:]]
    for j in jobs:
        assert j.wait(30)
    return jobs


def test_queued_store_jobs_share_one_transaction(engine: TransferEngine) -> None:
    groups = [_moves(2, s) for s in range(6)]
    before = _txnid(engine.disk)
    jobs = _stalled_then_queued(engine, groups)
    assert all(j.error is None and all(m.ok for m in j.moves) for j in jobs)
    assert _txnid(engine.disk) - before == 2  # the held job, then the five queued behind it in one
    for m in (m for g in groups for m in g):
        got = engine.disk.read(m.lmdb_key, lambda v, k=m.key: decode_block(v, layout=LAYOUT, fingerprint=FP, key=k))
        assert bytes(np.asarray(got).view(np.uint8)) == m.view.tobytes()


def test_merged_transactions_keep_the_batch_limits(engine: TransferEngine) -> None:
    engine.writes.batch = 3  # blocks per transaction
    groups = [_moves(1, 10 + s) for s in range(7)]
    before = _txnid(engine.disk)
    jobs = _stalled_then_queued(engine, groups)
    assert all(j.error is None for j in jobs)
    assert _txnid(engine.disk) - before == 1 + 2  # the held job; then 3 + 3 of the six queued


def test_a_failed_merged_transaction_fails_each_job_and_counts_nothing(engine: TransferEngine) -> None:
    def fail(op: str) -> None:
        if op == "write":
            raise OSError(errno.EIO, "injected EIO on disk write")

    groups = [_moves(2, 20 + s) for s in range(4)]
    disk = engine.disk
    with disk._write_lock:
        first = engine.submit(TO_DISK, groups[0])
        _wait_dequeued(engine)
        disk.fault = fail
        rest = [engine.submit(TO_DISK, g) for g in groups[1:]]
    for j in [first, *rest]:
        assert j.wait(30)
    disk.fault = None
    assert first.error is not None  # the fault was set before the held job reached LMDB
    for j in rest:
        assert j.error is not None and "I/O" in str(j.error)
        assert not any(m.ok for m in j.moves)
    assert list(disk.scan()) == []


def test_blocks_of_a_committed_batch_count_when_a_later_batch_fails(engine: TransferEngine) -> None:
    """A job of several transactions whose second fails: the first's blocks are on disk and ``ok``."""
    engine.writes.batch = 2
    calls = []

    def second_fails(op: str) -> None:
        if op == "write":
            calls.append(op)
            if len(calls) == 2:
                raise OSError(errno.EIO, "injected EIO on disk write")

    engine.disk.fault = second_fails
    moves = _moves(5, 30)
    job = engine.submit(TO_DISK, moves)
    assert job.wait(30)
    engine.disk.fault = None
    assert job.error is not None
    assert [m.ok for m in moves] == [True, True, False, False, False]  # the job stops at the failure
    on_disk = {bytes(k) for k, _ in engine.disk.scan()}
    assert on_disk == {m.lmdb_key for m in moves if m.ok}


def test_the_writeback_kick_runs_only_during_commits(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "disk", 64 << 20)
    tier.write([(b"k%d" % i, bytes(200_000)) for i in range(8)])
    kick = tier._writeback
    assert kick._thread is not None and kick._thread.is_alive()
    assert not kick._active.is_set()
    tier.flush()
    assert tier.read(b"k3", bytes) == bytes(200_000)
    tier.close()
    assert not kick._thread.is_alive() and kick._fd is None
    unsynced = DiskTier(tmp_path / "nosync", 64 << 20, sync=False)  # no fsync: nothing to start early
    unsynced.write([(b"k", b"v")])
    assert unsynced._writeback._fd is None and unsynced._writeback._thread is None
    unsynced.close()


def test_streamed_durable_put_chunks_grow_and_cover_every_block(monkeypatch) -> None:
    monkeypatch.setattr(tierkv.client.durable, "DURABLE_FIRST_CHUNK_BYTES", 4 << 20)
    monkeypatch.setattr(tierkv.client.durable, "DURABLE_CHUNK_BYTES", 32 << 20)
    mib2 = 2 << 20
    assert _durable_chunks(64, mib2) == [(0, 2), (2, 6), (6, 14), (14, 30), (30, 46), (46, 64)]
    assert _durable_chunks(2, mib2) == [(0, 2)]
    assert _durable_chunks(4, mib2) == [(0, 4)]  # a tail no longer than the first chunk rides along
    assert _durable_chunks(1, 64 << 20) == [(0, 1)]  # a block larger than a chunk is one chunk
    monkeypatch.setattr(tierkv.client.durable, "DURABLE_CHUNK_BYTES", 4 * 8192)  # first chunk capped by the chunk
    assert _durable_chunks(30, 8192) == [(lo, min(30, lo + 4)) for lo in range(0, 28, 4)][:-1] + [(24, 30)]
    for n in range(1, 200):
        chunks = _durable_chunks(n, mib2)
        assert chunks[0][0] == 0 and chunks[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))


def test_a_background_job_encodes_in_the_idle_class_and_gives_way_to_a_job_queued_behind(tmp_path: Path) -> None:
    """Write-behind encodes on threads in the idle scheduling class. While its encodes cannot run (the
    cores are taken), a job queued behind it does not wait: the background job writes what was encoded,
    leaves the rest unwritten (ok False, no error) and the job behind it is written."""
    import os
    import threading

    tier = DiskTier(tmp_path / "disk", 64 << 20)
    engine = TransferEngine(tier, workers=2, codec="raw", write_nice=10, background_idle=True)
    try:
        assert engine._encode_bg.submit(os.sched_getscheduler, 0).result() == os.SCHED_IDLE
        assert engine._encode.submit(os.sched_getscheduler, 0).result() == os.SCHED_OTHER
        free = engine.submit(TO_DISK, _moves(3, 7), background=True)
        assert free.wait(30) and free.error is None and all(m.ok for m in free.moves)  # cores free: all written
        held = threading.Event()
        blockers = [engine._encode_bg.submit(held.wait, 30) for _ in range(2)]  # the idle threads get no core
        bg = engine.submit(TO_DISK, _moves(4, 8), background=True)
        time.sleep(0.1)
        assert not bg.done.is_set()  # waits for its encodes while nothing is queued behind it
        fg = engine.submit(TO_DISK, _moves(2, 9))
        assert fg.wait(10) and fg.error is None and all(m.ok for m in fg.moves)
        assert bg.done.is_set() and bg.error is None and not any(m.ok for m in bg.moves)
        held.set()
        for b in blockers:
            b.result(30)
        for m in bg.moves:  # nothing of the job that gave way reached the disk
            assert tier.read(m.lmdb_key, bytes) is None
        assert tier.read(fg.moves[0].lmdb_key, bytes) is not None
    finally:
        engine.close()
        tier.close()

"""The remote mover: inside the transfer engine against a real redis-server (encodes for the remote tier,
reuses the disk tier's blobs, paces writes by the host<->remote budget), and over an in-memory tier
(round trips, corrupt values, a tier that stops taking writes, bad input)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import tierkv
import tierkv.movers.remote as remote_mover
from tests import redis_servers
from tests.redis_servers import need_redis
from tierkv.codecs import encode_block
from tierkv.core.errors import BadRequest
from tierkv.core.keys import Namespace
from tierkv.movers.engine import Move, TransferEngine
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.remote import RemoteTier, remote_key

redis_server = redis_servers.redis_server

LAYOUT = tierkv.Layout(num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=16, dtype="bfloat16")
FP = Namespace("mover-model", LAYOUT).fingerprint
TO_DISK, TO_REMOTE, FROM_REMOTE = ("host", "disk"), ("host", "remote"), ("remote", "host")


def _blocks(n: int, seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(LAYOUT.batch_shape(n), generator=g).to(torch.bfloat16)
    return t.view(torch.uint8).numpy().reshape(n, LAYOUT.block_bytes).copy()


def _moves(raw: np.ndarray, tag: str) -> list[Move]:
    keys = [f"{tag}{i:04d}".encode() for i in range(len(raw))]
    return [Move(FP + k, raw[i], LAYOUT, FP, k) for i, k in enumerate(keys)]


@pytest.fixture
def engine(tmp_path):
    disk = DiskTier(tmp_path / "disk", 64 << 20, sync=False)
    eng = TransferEngine(disk, workers=2, codec="lossless")
    yield eng
    eng.close()
    disk.close()


def _count_encodes(monkeypatch) -> list[int]:
    calls = [0]
    real = remote_mover.encode_block

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(remote_mover, "encode_block", counting)
    return calls


@need_redis
def test_blocks_on_disk_are_sent_as_stored(engine, redis_server, monkeypatch):
    raw = _blocks(6, seed=1)
    on_disk = _moves(raw, "reuse-")
    assert engine.submit(TO_DISK, on_disk).wait(10) and all(m.ok for m in on_disk)
    calls = _count_encodes(monkeypatch)
    tier = RemoteTier(redis_server.url, codec="lossless")
    engine.attach_remote(tier)
    job = engine.submit(TO_REMOTE, _moves(raw, "reuse-"))
    assert job.wait(10) and all(m.ok for m in job.moves)
    assert calls[0] == 0  # every block came from the disk tier's blob
    admin = redis_server.admin()
    for m in on_disk:
        blob = engine.disk.read(m.lmdb_key, bytes)
        assert admin.get(remote_key(FP, m.key)) == blob
    back = np.zeros_like(raw)
    moves = [Move(m.lmdb_key, back[i], LAYOUT, FP, m.key) for i, m in enumerate(on_disk)]
    assert engine.submit(FROM_REMOTE, moves).wait(10) and all(m.ok for m in moves)
    assert np.array_equal(back, raw)
    tier.close()


@need_redis
def test_other_codec_or_absent_from_disk_is_encoded(engine, redis_server, monkeypatch):
    raw = _blocks(4, seed=2)
    assert engine.submit(TO_DISK, _moves(raw[:2], "enc-")).wait(10)
    calls = _count_encodes(monkeypatch)
    tier = RemoteTier(redis_server.url, codec="int8")  # the disk holds lossless blobs
    engine.attach_remote(tier)
    job = engine.submit(TO_REMOTE, _moves(raw, "enc-"))
    assert job.wait(10) and all(m.ok for m in job.moves)
    assert calls[0] == 4
    k = b"enc-0000"
    want = encode_block(raw[0], layout=LAYOUT, fingerprint=FP, key=k, codec="int8")
    assert redis_server.admin().get(remote_key(FP, k)) == want
    tier.codec = "lossless"
    job = engine.submit(TO_REMOTE, _moves(raw, "enc-"))
    assert job.wait(10) and all(m.ok for m in job.moves)
    assert calls[0] == 6  # two reused from disk, two not on disk
    tier.close()


@need_redis
def test_writes_follow_the_budget(engine, redis_server):
    rate = 200e3
    engine.budgets.set_rate("host<->remote", rate)
    raw = _blocks(32, seed=3)  # 256 KiB raw in one job
    tier = RemoteTier(redis_server.url, codec="raw")  # raw: the bytes sent are known
    engine.attach_remote(tier)
    t0 = time.perf_counter()
    job = engine.submit(TO_REMOTE, _moves(raw, "paced-"))
    assert job.wait(30) and all(m.ok for m in job.moves)
    elapsed = time.perf_counter() - t0
    sent = tier.stats()["bytes_in"]
    link = engine.budgets.stats()["host<->remote"]
    assert link.bytes == sent and link.wait_s > 0
    assert elapsed >= (sent - link.burst) / rate * 0.8, (elapsed, sent)
    tier.close()


class FakeTier:
    """The remote tier's byte interface over a dict (no server): what the mover relies on."""

    def __init__(self, codec: str = "lossless", max_batch: int = 3) -> None:
        self.codec, self.max_batch = codec, max_batch
        self.values: dict[tuple[bytes, bytes], bytes] = {}
        self.up = True
        self.puts = self.dropped = 0
        self.corrupt: list[tuple[bytes, bytes]] = []
        self.down_after: int | None = None  # go read-only after this many puts

    def writable(self) -> bool:
        return self.up

    def put_many(self, items):
        for fp, k, blob in items:
            self.values[(fp, k)] = bytes(blob)
        self.puts += len(items)
        if self.down_after is not None and self.puts >= self.down_after:
            self.up = False
        return [True] * len(items)

    def count_dropped(self, n: int) -> None:
        self.dropped += n

    def read_each(self, items, use, *, limit):
        ok = []
        for i, item in enumerate(items):
            v = self.values.get(item)
            ok.append(v is not None and len(v) <= limit and use(i, memoryview(v)))
        return ok

    def drop_corrupt(self, items, *, delete=True, foreign=0):
        self.corrupt += items
        for item in items:
            self.values.pop(item, None)


def test_mover_round_trip_and_corrupt_values_without_a_server():
    tier = FakeTier()
    mover = remote_mover.RemoteMover(tier)
    raw = _blocks(5, seed=4)
    ks = [b"f%d" % i for i in range(5)]
    assert mover.store([(FP, k, raw[i]) for i, k in enumerate(ks)], LAYOUT) == [True] * 5
    assert mover.encoded == 5 and mover.reused == 0
    tier.values[(FP, ks[1])] = tier.values[(FP, ks[2])]  # another key's value
    tier.values[(FP, ks[3])] = b"garbage"
    out = np.zeros_like(raw)
    assert mover.fetch([(FP, k) for k in ks], LAYOUT, list(out)) == [True, False, True, False, True]
    assert np.array_equal(out[[0, 2, 4]], raw[[0, 2, 4]])
    assert sorted(tier.corrupt) == [(FP, ks[1]), (FP, ks[3])] and (FP, ks[1]) not in tier.values
    with pytest.raises(BadRequest):
        mover.fetch([(FP, ks[0])], LAYOUT, [])
    mover.close()


def test_mover_stops_encoding_once_the_tier_refuses_writes():
    tier = FakeTier(max_batch=2)
    tier.down_after = 2
    mover = remote_mover.RemoteMover(tier)
    raw = _blocks(8, seed=5)
    ok = mover.store([(FP, b"s%d" % i, raw[i]) for i in range(8)], LAYOUT)
    assert ok[:2] == [True, True] and not any(ok[4:]) and tier.dropped >= 4
    assert mover.encoded <= 4  # the batch in flight when the tier went read-only, no more
    tier.up = False
    assert mover.store([(FP, b"x", raw[0])], LAYOUT) == [False] and mover.encoded <= 4
    mover.close()


def test_mover_rejects_bad_settings_and_codecs():
    with pytest.raises(ValueError):
        remote_mover.RemoteMover(FakeTier(), encode_workers=0)
    mover = remote_mover.RemoteMover(FakeTier())
    with pytest.raises(ValueError):
        mover.store([(FP, b"k", _blocks(1, seed=6)[0])], LAYOUT, codec="nope")
    with pytest.raises(BadRequest):
        mover.store([(FP, b"k", b"short")], LAYOUT)
    mover.close()

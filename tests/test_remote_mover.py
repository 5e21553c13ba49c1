"""The remote mover inside the transfer engine: encodes for the remote tier, reuses the disk tier's blobs,
paces writes by the host<->remote budget (real redis-server, in-process engine and disk tier)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import tierkv
import tierkv.movers.remote as remote_mover
from tierkv.codecs import encode_block
from tierkv.core.keys import Namespace
from tierkv.movers.transfer import Move, TransferEngine
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.remote import RemoteTier, remote_key

from . import redis_servers
from .redis_servers import need_redis

redis_server = redis_servers.redis_server

LAYOUT = tierkv.Layout(num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=16, dtype="bfloat16")
FP = Namespace("mover-model", LAYOUT).fingerprint


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
    assert engine.store(on_disk).wait(10) and all(m.ok for m in on_disk)
    calls = _count_encodes(monkeypatch)
    tier = RemoteTier(redis_server.url, codec="lossless")
    job = engine.store_remote(tier, _moves(raw, "reuse-"))
    assert job.wait(10) and all(m.ok for m in job.moves)
    assert calls[0] == 0  # every block came from the disk tier's blob
    admin = redis_server.admin()
    for m in on_disk:
        blob = engine.disk.read(m.lmdb_key, bytes)
        assert admin.get(remote_key(FP, m.key)) == blob
    back = np.zeros_like(raw)
    moves = [Move(m.lmdb_key, back[i], LAYOUT, FP, m.key) for i, m in enumerate(on_disk)]
    assert engine.load_remote(tier, moves).wait(10) and all(m.ok for m in moves)
    assert np.array_equal(back, raw)
    tier.close()


@need_redis
def test_other_codec_or_absent_from_disk_is_encoded(engine, redis_server, monkeypatch):
    raw = _blocks(4, seed=2)
    assert engine.store(_moves(raw[:2], "enc-")).wait(10)
    calls = _count_encodes(monkeypatch)
    tier = RemoteTier(redis_server.url, codec="int8")  # the disk holds lossless blobs
    job = engine.store_remote(tier, _moves(raw, "enc-"))
    assert job.wait(10) and all(m.ok for m in job.moves)
    assert calls[0] == 4
    k = b"enc-0000"
    want = encode_block(raw[0], layout=LAYOUT, fingerprint=FP, key=k, codec="int8")
    assert redis_server.admin().get(remote_key(FP, k)) == want
    tier.codec = "lossless"
    job = engine.store_remote(tier, _moves(raw, "enc-"))
    assert job.wait(10) and all(m.ok for m in job.moves)
    assert calls[0] == 6  # two reused from disk, two not on disk
    tier.close()


@need_redis
def test_writes_follow_the_budget(engine, redis_server):
    rate = 200e3
    engine.budgets.set_rate("host<->remote", rate)
    raw = _blocks(32, seed=3)  # 256 KiB raw in one job
    tier = RemoteTier(redis_server.url, codec="raw")  # raw: the bytes sent are known
    t0 = time.perf_counter()
    job = engine.store_remote(tier, _moves(raw, "paced-"))
    assert job.wait(30) and all(m.ok for m in job.moves)
    elapsed = time.perf_counter() - t0
    sent = tier.stats()["bytes_in"]
    link = engine.budgets.stats()["host<->remote"]
    assert link.bytes == sent and link.wait_s > 0
    assert elapsed >= (sent - link.burst) / rate * 0.8, (elapsed, sent)
    tier.close()

"""The remote mover inside the transfer engine: paces writes by the host<->remote budget (real
redis-server, in-process engine and disk tier)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import tierkv
from tierkv.core.keys import Namespace
from tierkv.movers.transfer import Move, TransferEngine
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.remote import RemoteTier

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

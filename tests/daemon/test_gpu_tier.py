"""The GPU tier on a live daemon: the CPU stand-in here (same block table, protocol and transfer code,
threads in place of CUDA streams), and `gpu`-marked tests for CUDA IPC, pinned registration and streams."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import tierkv
from tests.helpers import REPO, SMALL, keys_for, rand_blocks, wait_for
from tierkv.core.errors import BadRequest, KeyMissing

STANDIN = ["--gpu-capacity", "8MiB", "--gpu-device", "cpu"]  # 8 MiB / 8 KiB slots: 1,024 blocks


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


def _wait_for(pred, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")


@pytest.fixture
def gdaemon(daemon_factory):
    return daemon_factory(STANDIN)


def test_standin_store_drains_to_host_and_disk_and_loads_back(gdaemon):
    with gdaemon.client() as c:
        assert c.gpu_device == "cpu"
        assert list(c.stats()["tiers"])[:3] == ["gpu", "host", "disk"]  # hottest first
        keys, blocks = keys_for(c, 16, seed=1), rand_blocks(16, seed=1)
        with c.alloc(16, tier="gpu") as slots:
            assert slots.tier == "gpu" and len(slots.views) == 16
            for i, v in enumerate(slots.views):
                v.copy_(blocks[i])
            assert slots.commit(keys) == 16
        assert c.lookup_tiers(keys) == ["gpu"] * 16
        # the drain makes host copies in the background
        _wait_for(lambda: c.stats()["tiers"]["gpu"]["draining"] == 0)
        st = c.stats()["tiers"]
        assert st["gpu"]["blocks"] == 16 and st["host"]["blocks"] == 16 and st["gpu"]["kind"] == "standin"
        assert _same(c.get(keys), blocks)                    # host path
        assert _same(c.get(keys, tier="gpu"), blocks)        # gpu path: device views
        with c.acquire(keys, tier="gpu") as lease:
            assert lease.tier == "gpu" and lease.tiers == ["gpu"] * 16
            assert all(_same(v, blocks[i]) for i, v in enumerate(lease.views))
        c.put(keys, blocks, durable=True)  # now also on disk
    gdaemon.restart()  # GPU and host memory are gone: disk -> host -> gpu
    with gdaemon.client() as c:
        assert c.lookup_tiers(keys) == ["disk"] * 16
        with c.wait(c.fetch(keys, tier="gpu"), timeout=None) as lease:
            assert lease.count == 16 and lease.tier == "gpu" and set(lease.tiers) == {"disk"}
            assert all(_same(v, blocks[i]) for i, v in enumerate(lease.views))
        assert c.lookup_tiers(keys) == ["gpu"] * 16
        st = c.stats()
        assert st["leases"] == 0 and st["tiers"]["gpu"]["promotions"] == 16


def test_put_to_gpu_dedups_and_durable_reaches_disk(gdaemon):
    with gdaemon.client() as c:
        keys, blocks = keys_for(c, 8, seed=2), rand_blocks(8, seed=2)
        assert c.put(keys[:4], blocks[:4]) == 4                    # host
        assert c.put(keys, blocks, tier="gpu") == 4                # the 4 cached ones are deduplicated
        assert c.put(keys, blocks, tier="gpu", durable=True) == 0  # returns once synced to disk
        st = c.stats()["tiers"]
        assert st["disk"]["blocks"] == 8
        assert _same(c.get(keys, tier="gpu"), blocks)
    gdaemon.kill()  # durable means durable: survives kill -9
    gdaemon.start()
    with gdaemon.client() as c:
        assert _same(c.get(keys), blocks)


def test_gpu_eviction_keeps_blocks_in_colder_tiers(daemon_factory):
    d = daemon_factory(["--gpu-capacity", "1MiB", "--gpu-device", "cpu", "--slab-bytes", "1MiB"])
    with d.client() as c:
        keys, blocks = keys_for(c, 512, seed=3), rand_blocks(512, seed=3)  # 4 MiB through a 1 MiB GPU tier
        for i in range(0, 512, 64):
            c.put(keys[i:i + 64], blocks[i:i + 64], tier="gpu")
        _wait_for(lambda: c.stats()["tiers"]["gpu"]["draining"] == 0)
        st = c.stats()["tiers"]["gpu"]
        assert st["used_bytes"] <= st["capacity_bytes"] and st["evictions"] >= 384
        assert c.lookup(keys) == 512
        assert _same(c.get(keys), blocks)
        for i in range(0, 512, 64):  # back through the GPU tier, in GPU-sized batches
            assert _same(c.get(keys[i:i + 64], tier="gpu"), blocks[i:i + 64])
        # a lease larger than the GPU tier gets the prefix that fits, never an error or a hang
        with c.acquire(keys, tier="gpu") as lease:
            assert 0 < lease.count <= 128
            assert all(_same(v, blocks[i]) for i, v in enumerate(lease.views))


def test_gpu_leases_end_with_the_connection_and_prefetch(gdaemon):
    code = f"""
import os, sys, time
sys.path.insert(0, {str(REPO)!r})
import tierkv, torch
from tests.helpers import SMALL
c = tierkv.Client.connect({gdaemon.socket!r}, model="test-model", layout=SMALL)
keys = [bytes([i + 1]) * 16 for i in range(8)]
c.put(keys, torch.zeros(SMALL.batch_shape(8), dtype=SMALL.torch_dtype), tier="gpu")
lease = c.acquire(keys, tier="gpu")
slots = c.alloc(4, tier="gpu")
print(lease.count, flush=True)
time.sleep(60)
"""
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "8"
        assert gdaemon.stats()["leases"] == 8
        p.send_signal(signal.SIGKILL)
        p.wait()
        _wait_for(lambda: gdaemon.stats()["leases"] == 0 and gdaemon.stats()["tiers"]["gpu"]["used_bytes"] == 8 * 8192)
        st = gdaemon.stats()["tiers"]["gpu"]
        assert st["used_bytes"] == 8 * 8192  # the 4 uncommitted slots came back
    finally:
        p.kill()
    with gdaemon.client() as c:
        keys = [bytes([i + 1]) * 16 for i in range(8)]
        c.put(keys[:2], torch.ones(SMALL.batch_shape(2), dtype=SMALL.torch_dtype))
        assert c.prefetch(keys, tier="gpu") == 0  # already there
        assert c.delete(keys) == 8  # unleased: droppable from every tier
        _wait_for(lambda: c.stats()["tiers"]["gpu"]["used_bytes"] == 0)


def test_bad_gpu_requests_are_clear_errors(daemon, gdaemon):
    with daemon.client() as c:  # no GPU tier
        assert c.gpu_device is None
        with pytest.raises(BadRequest, match="GPU tier"):
            c.alloc(1, tier="gpu")
        with pytest.raises(BadRequest, match="GPU tier"):
            c.put(keys_for(c, 1), rand_blocks(1), tier="gpu")
    with gdaemon.client() as c:
        with pytest.raises(BadRequest, match="tier must be"):
            c.acquire(keys_for(c, 1), tier="nvme")
        with pytest.raises(BadRequest, match="tier must be"):
            c._call(tierkv.client.client.Op.FETCH, {"keys": keys_for(c, 1), "tier": 7})
        host = c.alloc(1)
        with pytest.raises(BadRequest, match="GPU slot"):  # a host slot is not a GPU slot
            c._call(tierkv.client.client.Op.COMMIT, {"keys": keys_for(c, 1), "slots": host.offsets, "tier": "gpu"})
        host.abort()
        with pytest.raises(BadRequest, match="exceed the GPU tier"):
            c.alloc(2000, tier="gpu")
        with pytest.raises(KeyMissing):
            c.get(keys_for(c, 2, seed=9), tier="gpu")
        with pytest.raises(BadRequest, match="shape"):
            c.put(keys_for(c, 2), rand_blocks(3), tier="gpu")
        assert c.stats()["leases"] == 0 and c.stats()["tiers"]["gpu"]["used_bytes"] == 0


def test_gpu_settings_are_checked(daemon_factory):
    d = daemon_factory(["--gpu-capacity", "8MiB", "--gpu-device", "tpu"], start=False)
    with pytest.raises(RuntimeError, match="gpu.device"):
        d.start()
    assert "Traceback" not in d.log.read_text()  # one clear line, no traceback
    if not torch.cuda.is_available():
        d2 = daemon_factory(["--gpu-capacity", "8MiB", "--gpu-device", "cuda"], start=False)
        with pytest.raises(RuntimeError, match="no CUDA device"):
            d2.start()
        assert "Traceback" not in d2.log.read_text()


def test_budget_caps_the_gpu_link(daemon_factory):
    d = daemon_factory([*STANDIN, "--gpu-capacity", "64MiB"], env={"TIERKV_BUDGET_GPU_HOST": "16MiB"})
    layout = tierkv.Layout(4, 4, 64, 16, "bfloat16")  # 64 KiB blocks
    with d.client(layout=layout) as c:
        keys, blocks = keys_for(c, 512, seed=4), rand_blocks(512, layout, seed=4)  # 32 MiB
        t0 = time.monotonic()
        c.put(keys, blocks, tier="gpu")
        _wait_for(lambda: c.stats()["tiers"]["gpu"]["draining"] == 0, timeout=30)
        took = time.monotonic() - t0
        link = c.stats()["transfer"]["links"]["gpu<->host"]
        # 32 MiB at 16 MiB/s with a 50 ms burst: about 2 s; within 10% (plus the burst) of the cap
        assert took >= 2.0 * 0.9 - 0.1, took
        assert link["bytes"] >= 32 << 20


# ---- real CUDA ----------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_cuda_ipc_store_and_load(daemon_factory):
    d = daemon_factory(["--gpu-capacity", "256MiB", "--gpu-device", "cuda"])
    with d.client() as c:
        assert c.gpu_device == "cuda:0"
        keys = keys_for(c, 64, seed=5)
        blocks = rand_blocks(64, seed=5).cuda()
        assert c.put(keys, blocks) == 64  # a CUDA tensor goes through the GPU tier by default (D2D)
        st = c.stats()["tiers"]["gpu"]
        assert st["kind"] == "cuda" and st["host_pinned"] is True
        out = c.get(keys, out=torch.empty_like(blocks))
        assert out.is_cuda and _same(out, blocks)
        _wait_for(lambda: c.stats()["tiers"]["gpu"]["draining"] == 0)
        assert _same(c.get(keys, tier="host"), blocks.cpu())  # drained GPU -> pinned host


@pytest.mark.gpu
def test_cuda_promotion_from_disk_and_views_are_device_tensors(daemon_factory):
    d = daemon_factory(["--gpu-capacity", "64MiB", "--gpu-device", "cuda"])
    with d.client() as c:
        keys, blocks = keys_for(c, 32, seed=6), rand_blocks(32, seed=6)
        c.put(keys, blocks, durable=True)
    d.restart()
    with d.client() as c:
        with c.wait(c.fetch(keys, tier="gpu"), timeout=None) as lease:
            assert lease.count == 32
            assert all(v.is_cuda for v in lease.views)
            assert all(_same(v, blocks[i]) for i, v in enumerate(lease.views))


@pytest.mark.gpu
def test_cuda_streams_and_pinned_registration_in_process():
    from tierkv.core import cuda
    from tierkv.movers.streams import Copy, make_queue
    from tierkv.tiers.gpu import DevicePool
    from tierkv.tiers.host import HostPool

    host = HostPool(64 << 20, 8 << 20)
    dev = DevicePool(64 << 20, 8 << 20, "cuda")
    ptr = int(host.array.ctypes.data)
    cuda.host_register(ptr, host.capacity)
    try:
        assert cuda.is_pinned(ptr)
        q = make_queue("cuda", "test", 0, high_priority=True)
        src = torch.from_numpy(host.view(0, 8 << 20))
        src.copy_(torch.randint(0, 255, (8 << 20,), dtype=torch.uint8))
        done = []
        q.submit([Copy(src, dev.view(0, 8 << 20))], lambda cs: done.append(all(c.ok for c in cs)))
        _wait_for(lambda: done == [True])
        assert torch.equal(dev.view(0, 8 << 20).cpu(), src)
        q.close()
    finally:
        cuda.host_unregister(ptr)
        dev.close()
        host.close()
    assert os.environ.get("CUDA_VISIBLE_DEVICES", "0") != ""


def test_copy_queue_merges_adjacent_slots_and_reports_sources_that_never_arrived():
    from tierkv.movers.streams import Copy, _runs, make_queue

    src = torch.arange(200, dtype=torch.uint8)
    dst = torch.zeros(200, dtype=torch.uint8)
    copies = [Copy(src[0:10], dst[100:110]), Copy(src[10:20], dst[110:120]),   # one run
              Copy(src[50:60], dst[0:10], ready=lambda: False),               # never arrived
              Copy(src[60:70], dst[10:20]), Copy(src[80:90], dst[20:30])]     # not adjacent: two copies
    assert [(s.numel(), len(m)) for s, _d, m in _runs(copies)] == [(20, 2), (10, 1), (10, 1)]
    q = make_queue("standin", "test")
    got: list[list[bool]] = []
    q.submit(copies, lambda cs: got.append([c.ok for c in cs]))
    _wait_for(lambda: bool(got))
    q.close()
    assert got == [[True, True, False, True, True]]
    assert torch.equal(dst[100:120], src[0:20]) and torch.equal(dst[0:10], torch.zeros(10, dtype=torch.uint8))
    assert torch.equal(dst[10:20], src[60:70]) and torch.equal(dst[20:30], src[80:90])


def _paged_round_trip(c, device: str, tier: str | None) -> None:
    L, H, T, D = 2, 2, 16, 32  # SMALL
    g = torch.Generator().manual_seed(7)
    k_cache = [torch.randn(10, T, H, D, generator=g).to(torch.bfloat16).to(device) for _ in range(L)]
    v_cache = [torch.randn(10, T, H, D, generator=g).to(torch.bfloat16).to(device) for _ in range(L)]
    keys = keys_for(c, 3, seed=8)
    assert c.store_paged(keys, k_cache, v_cache, [7, 2, 5], tier=tier) == 3
    assert c.lookup_tiers(keys) == ["gpu"] * 3
    k2 = [torch.zeros_like(x) for x in k_cache]
    v2 = [torch.zeros_like(x) for x in v_cache]
    assert c.load_paged(keys, k2, v2, [0, 1, 9], tier=tier) == 3
    for src, dst in ((7, 0), (2, 1), (5, 9)):
        for layer in range(L):
            assert torch.equal(k2[layer][dst], k_cache[layer][src])
            assert torch.equal(v2[layer][dst], v_cache[layer][src])
    assert wait_for(lambda: c.stats()["leases"] == 0, timeout=30)  # the drains' reads of the slots end too


def test_paged_offload_through_gpu_slots_standin(gdaemon):
    with gdaemon.client() as c:
        _paged_round_trip(c, "cpu", "gpu")


@pytest.mark.gpu
def test_cuda_paged_offload_straight_into_gpu_slots(daemon_factory):
    d = daemon_factory(["--gpu-capacity", "64MiB", "--gpu-device", "cuda"])
    with d.client() as c:
        _paged_round_trip(c, "cuda", None)  # CUDA caches pick the GPU tier by themselves

from __future__ import annotations

import random

import pytest

from tierkv.core.units import parse_size
from tierkv.tiers.host import HostPool, slot_size_for


def test_slab_classes_share_one_pool():
    pool = HostPool(8 << 20, 1 << 20, prefault=False)
    a, b = slot_size_for(300_000), slot_size_for(100_000)
    offs_a = [pool.alloc(a) for _ in range(6)]
    offs_b = [pool.alloc(b) for _ in range(20)]
    assert None not in offs_a and None not in offs_b
    assert pool.slab_usage() == {a: 2, b: 2}
    assert len(set(offs_a + offs_b)) == 26
    for o in offs_a:  # every slot of class a returned: its slabs go back to the free list
        pool.free(o)
    assert a not in pool.slab_usage()
    assert pool.used_bytes == 20 * b
    pool.close()


def test_fill_and_fragmentation():
    pool = HostPool(4 << 20, 1 << 20, prefault=False)
    s = slot_size_for(400_000)  # 2 per slab
    offs = []
    while (o := pool.alloc(s)) is not None:
        offs.append(o)
    assert len(offs) == 8
    assert pool.alloc(s) is None and pool.alloc(slot_size_for(1 << 20)) is None  # full
    assert 0 < pool.fragmentation(8 * 400_000) < 0.3
    random.Random(0).shuffle(offs)
    for o in offs:
        pool.free(o)
    assert pool.used_bytes == 0
    pool.free(pool.alloc(slot_size_for(1 << 20)))  # every slab is free again
    with pytest.raises(ValueError):
        pool.alloc((1 << 20) + 4096)
    pool.close()


def test_views_are_shared_memory():
    import mmap
    import os

    pool = HostPool(2 << 20, 1 << 20, prefault=True)
    off = pool.alloc(4096)
    pool.view(off, 4096)[:] = 7
    mm = mmap.mmap(pool.fd, pool.capacity)  # what a client maps after SCM_RIGHTS
    assert mm[off:off + 4096] == b"\x07" * 4096
    mm.close()
    with pytest.raises(OSError):
        os.ftruncate(pool.fd, 4096)  # sealed: nobody can shrink the pool under the daemon
    pool.close()


def test_pool_smaller_than_a_slab_is_one_slab():
    pool = HostPool((8 << 20) + 100, 32 << 20, prefault=False)
    assert pool.slab_bytes == pool.capacity == 8 << 20 and pool.nslabs == 1
    s = slot_size_for(1 << 20)
    assert [pool.alloc(s) is not None for _ in range(9)] == [True] * 8 + [False]
    pool.close()


@pytest.mark.parametrize("capacity,slab", [(100, 4096), (1 << 20, 5000), (1 << 20, 0)])
def test_pool_bad_sizes(capacity, slab):
    with pytest.raises(ValueError, match="4 KiB"):
        HostPool(capacity, slab, prefault=False)


@pytest.mark.parametrize("capacity", ["8MiB", "16MiB"])
def test_small_host_tier_serves(daemon_factory, capacity):
    """A host tier below the default 32 MiB slab starts and serves puts and gets (past its size too)."""
    import torch

    import tierkv
    from tests.helpers import keys_for, rand_blocks

    layout = tierkv.Layout(num_layers=8, num_kv_heads=4, head_dim=64, block_tokens=16, dtype="bfloat16")
    d = daemon_factory(["--host-capacity", capacity, "--slab-bytes", "32MiB"])
    with d.client(layout=layout) as c:
        n = 2 * parse_size(capacity) // layout.block_bytes  # twice the host tier: the rest goes to disk
        keys, blocks = keys_for(c, n, seed=5), rand_blocks(n, layout, seed=5)
        half = n // 4  # one put holds at most the host tier
        for i in range(0, n, half):
            assert c.put(keys[i:i + half], blocks[i:i + half]) == half
        assert c.stats()["tiers"]["host"]["capacity_bytes"] == parse_size(capacity)
        assert c.lookup(keys) == n
        for i in range(0, n, half):
            got = c.get(keys[i:i + half])
            assert torch.equal(got.view(torch.int16), blocks[i:i + half].view(torch.int16))

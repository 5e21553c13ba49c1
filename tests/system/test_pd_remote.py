"""Prefill and decode on two nodes: daemons A and B share one Redis; a commit with ``remote=True`` on A
returns once its blocks are on the remote, so B finds the whole prompt right after it; B's lookups stay
bounded when the remote hangs."""

from __future__ import annotations

import time

import torch

from tests import redis_servers
from tests.helpers import keys_for, rand_blocks
from tests.redis_servers import need_redis

redis_server = redis_servers.redis_server
redis_factory = redis_servers.redis_factory

SLOW_LINK = {"TIERKV_BUDGET_HOST_REMOTE": "256KB"}  # 64 blocks of 8 KiB: over a second on the link


def _nodes(daemon_factory, url: str, admission: str = "reused", env_a: dict | None = None,
           env_b: dict | None = None, args_a: tuple[str, ...] = ()):
    args = ["--remote", url, "--remote-admission", admission]
    return daemon_factory([*args, *args_a], env=env_a), daemon_factory(args, env=env_b)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(got.view(torch.int16), want.view(torch.int16))


@need_redis
def test_a_remote_put_is_whole_on_the_other_node_when_it_returns(daemon_factory, redis_server):
    """Under admission ``reused`` fresh blocks are never written through; ``remote=True`` writes them
    all and returns after the write."""
    a, b = _nodes(daemon_factory, redis_server.url)
    with a.client() as ca, b.client() as cb:
        keys = keys_for(ca, 24, seed=11)
        plain = keys_for(ca, 8, seed=12)
        ca.put(plain, rand_blocks(8, seed=12))
        ca.put(keys[:16], rand_blocks(24, seed=11)[:16], remote=True)
        with ca.alloc(8) as slots:  # the zero-copy path continues the chain
            for view, block in zip(slots.views, rand_blocks(24, seed=11)[16:]):
                view.copy_(block)
            assert slots.commit(keys[16:], chains=[(0, keys[15])], remote=True) == 8
        assert cb.lookup_tiers(keys) == ["remote"] * 24  # no wait: on the remote at return
        assert _same(cb.get(keys), rand_blocks(24, seed=11))
        assert cb.lookup_tiers(keys) == ["host"] * 24
        assert ca.stats()["tiers"]["remote"]["puts"] == 24
        assert cb.lookup(plain) == 0  # the plain put: fresh blocks stay on A under ``reused``


@need_redis
def test_a_remote_put_waits_for_a_slow_link_and_a_plain_put_does_not(daemon_factory, redis_server):
    """A plain put returns before its write-through; a remote put waits for its own writes and for
    those already in flight of its blocks."""
    a, b = _nodes(daemon_factory, redis_server.url, admission="all", env_a=SLOW_LINK)
    with a.client() as ca, b.client() as cb:
        plain, pd = keys_for(ca, 64, seed=13), keys_for(ca, 64, seed=14)
        ca.put(plain, rand_blocks(64, seed=13))
        assert cb.lookup(plain) < 64  # written through in the background, behind the put's return
        ca.put(plain, rand_blocks(64, seed=13), remote=True)  # waits for the writes in flight
        assert cb.lookup(plain) == 64
        t0 = time.perf_counter()
        ca.put(pd, rand_blocks(64, seed=14), remote=True)
        took = time.perf_counter() - t0
        assert cb.lookup(pd) == 64 and cb.lookup_tiers(pd) == ["remote"] * 64
        assert took > 0.5, took  # it waited for the paced link
        assert _same(cb.get(pd), rand_blocks(64, seed=14))


@need_redis
def test_a_remote_put_of_cached_blocks_writes_them_through(daemon_factory, redis_server):
    """Blocks already cached on A (only there, as ``reused`` keeps fresh ones) are written too."""
    a, b = _nodes(daemon_factory, redis_server.url)
    with a.client() as ca, b.client() as cb:
        keys = keys_for(ca, 6, seed=15)
        assert ca.put(keys, rand_blocks(6, seed=15)) == 6
        assert cb.lookup(keys) == 0
        assert ca.put(keys, rand_blocks(6, seed=15), remote=True) == 0  # deduplicated, still written
        assert cb.lookup_tiers(keys) == ["remote"] * 6
        assert _same(cb.get(keys), rand_blocks(6, seed=15))


@need_redis
def test_a_remote_commit_also_writes_the_prefix_it_continues(daemon_factory, redis_server):
    """A producer that loaded a cached prefix from its own daemon commits only what it computed; the
    prefix that commit continues (by its chain links) is written through with it."""
    a, b = _nodes(daemon_factory, redis_server.url)
    with a.client() as ca, b.client() as cb:
        keys, data = keys_for(ca, 12, seed=17), rand_blocks(12, seed=17)
        ca.put(keys[:8], data[:8])  # an earlier request, on A only under ``reused``
        assert cb.lookup(keys) == 0
        ca.put(keys[8:], data[8:], parent=keys[7], remote=True)
        assert cb.lookup_tiers(keys) == ["remote"] * 12
        assert _same(cb.get(keys), data)


@need_redis
def test_a_remote_put_through_the_gpu_tier(daemon_factory, redis_server):
    """A GPU-tier commit reaches host memory first, then the remote, before the put returns."""
    a, b = _nodes(daemon_factory, redis_server.url, args_a=("--gpu-capacity", "8MiB", "--gpu-device", "cpu"))
    with a.client() as ca, b.client() as cb:
        keys = keys_for(ca, 10, seed=16)
        ca.put(keys, rand_blocks(10, seed=16), tier="gpu", remote=True)
        assert cb.lookup_tiers(keys) == ["remote"] * 10
        assert _same(cb.get(keys), rand_blocks(10, seed=16))


def test_remote_without_a_remote_tier_stores_locally_at_once(daemon_factory):
    d = daemon_factory()
    with d.client() as c:
        keys = keys_for(c, 8, seed=17)
        t0 = time.perf_counter()
        assert c.put(keys[:4], rand_blocks(8, seed=17)[:4], remote=True) == 4
        with c.alloc(4) as slots:
            for view, block in zip(slots.views, rand_blocks(8, seed=17)[4:]):
                view.copy_(block)
            assert slots.commit(keys[4:], chains=[(0, keys[3])], remote=True) == 4
        assert time.perf_counter() - t0 < 5
        assert c.lookup_tiers(keys) == ["host"] * 8
        assert _same(c.get(keys), rand_blocks(8, seed=17))
        assert "remote" not in c.stats()["tiers"]


@need_redis
def test_a_hung_remote_bounds_lookups_and_remote_commits(daemon_factory, redis_factory):
    """A Redis that accepts and never answers: B's lookup (the decode scheduler's) returns its local
    prefix within ``remote.socket_timeout_s``, then at once while the breaker is open; A's remote
    commit waits at most that long once, then returns at once and keeps the blocks locally."""
    srv = redis_factory()
    env = {"TIERKV_REMOTE_SOCKET_TIMEOUT_S": "1", "TIERKV_REMOTE_BACKOFF_S": "30",
           "TIERKV_REMOTE_MAX_BACKOFF_S": "60"}
    a, b = _nodes(daemon_factory, srv.url, env_a=env, env_b=env)
    with a.client() as ca, b.client() as cb:
        keys = keys_for(ca, 8, seed=18)
        cb.put(keys[:3], rand_blocks(8, seed=18)[:3])  # B holds the head, the remote the rest
        ca.put(keys, rand_blocks(8, seed=18), remote=True)
        assert cb.lookup_tiers(keys) == ["host"] * 3 + ["remote"] * 5
        srv.pause()
        try:
            t0 = time.perf_counter()
            assert cb.lookup(keys) == 3
            assert time.perf_counter() - t0 < 1 * 2 + 2  # one receive timeout, slack for a loaded machine
            t0 = time.perf_counter()
            for _ in range(20):
                assert cb.lookup(keys) == 3
            assert time.perf_counter() - t0 < 1.0  # the breaker is open: no network
            assert cb.health()["status"] == "degraded"
            more = keys_for(ca, 4, seed=19)
            t0 = time.perf_counter()
            ca.put(more[:2], rand_blocks(4, seed=19)[:2], remote=True)  # finds the remote hung
            assert time.perf_counter() - t0 < 1 * 2 + 2
            t0 = time.perf_counter()
            ca.put(more[2:], rand_blocks(4, seed=19)[2:], remote=True, parent=more[1])
            assert time.perf_counter() - t0 < 0.8  # the breaker is open: no wait
            assert ca.lookup_tiers(more) == ["host"] * 4
            assert ca.stats()["tiers"]["remote"]["put_dropped"] >= 2
        finally:
            srv.resume()

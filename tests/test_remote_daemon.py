"""The remote tier inside real daemons: two nodes (daemons with their own data dirs and host tiers)
share one Redis server or cluster."""

from __future__ import annotations

import json
import time

import torch
from click.testing import CliRunner

from tierkv.ops.cli import main

from . import redis_servers
from .helpers import keys_for, rand_blocks
from .redis_servers import need_redis

redis_server = redis_servers.redis_server
redis_cluster = redis_servers.redis_cluster
redis_factory = redis_servers.redis_factory


def _two_nodes(daemon_factory, url: str, admission: str = "all"):
    args = ["--remote", url, "--remote-admission", admission]
    return daemon_factory(args), daemon_factory(args)


def _wait_remote(c, keys, n, timeout=20.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if c.lookup(keys) >= n:
            return
        time.sleep(0.05)


@need_redis
def test_prefix_computed_on_a_is_a_hit_on_b(daemon_factory, redis_server):
    a, b = _two_nodes(daemon_factory, redis_server.url)
    with a.client() as ca:
        keys = keys_for(ca, 12, seed=1)
        ca.put(keys, rand_blocks(12, seed=1))
    with b.client() as cb:
        _wait_remote(cb, keys, 12)  # write-through is asynchronous
        assert cb.lookup_tiers(keys) == ["remote"] * 12
        got = cb.get(keys)
        assert torch.equal(got.view(torch.int16), rand_blocks(12, seed=1).view(torch.int16))
        assert cb.lookup_tiers(keys) == ["host"] * 12  # now local on B
        st = cb.stats()["tiers"]["remote"]
        assert st["state"] == "up" and st["hits"] >= 12
    r = CliRunner().invoke(main, ["stats", "--json", "--socket", b.socket])
    assert json.loads(r.output)["tiers"]["remote"]["blocks"] >= 12


@need_redis
def test_reused_admission_writes_on_second_use(daemon_factory, redis_server):
    a, b = _two_nodes(daemon_factory, redis_server.url, admission="reused")
    with a.client() as ca, b.client() as cb:
        once = keys_for(ca, 4, seed=2)
        twice = keys_for(ca, 4, seed=3)
        ca.put(once, rand_blocks(4, seed=2))
        ca.put(twice, rand_blocks(4, seed=3))
        ca.get(twice)  # second use: written through
        _wait_remote(cb, twice, 4)
        assert cb.lookup(twice) == 4
        assert cb.lookup(once) == 0


@need_redis
def test_cluster_shared_between_nodes(daemon_factory, redis_cluster):
    a, b = _two_nodes(daemon_factory, redis_cluster.url)
    with a.client() as ca:
        keys = keys_for(ca, 16, seed=4)
        ca.put(keys, rand_blocks(16, seed=4))
    with b.client() as cb:
        _wait_remote(cb, keys, 16)
        got = cb.get(keys)
        assert torch.equal(got.view(torch.int16), rand_blocks(16, seed=4).view(torch.int16))


@need_redis
def test_remote_down_is_a_miss_not_an_error(daemon_factory, redis_factory):
    srv = redis_factory()
    a, b = _two_nodes(daemon_factory, srv.url)
    with a.client() as ca:
        keys = keys_for(ca, 6, seed=5)
        ca.put(keys, rand_blocks(6, seed=5))
    with b.client() as cb:
        _wait_remote(cb, keys, 6)
        srv.kill()
        t0 = time.perf_counter()
        assert cb.lookup(keys) == 0  # misses, no errors, no hang past the timeout
        with cb.acquire(keys) as lease:
            assert lease.count == 0
        assert time.perf_counter() - t0 < 10
        assert cb.health()["status"] == "degraded"
        local = keys_for(cb, 3, seed=6)
        cb.put(local, rand_blocks(3, seed=6))  # the local tiers work on
        assert cb.lookup(local) == 3

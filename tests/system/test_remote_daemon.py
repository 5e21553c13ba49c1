"""The remote tier inside real daemons: two nodes (daemons with their own data dirs and host tiers)
share one Redis server or cluster."""

from __future__ import annotations

import json
import time

import torch
from click.testing import CliRunner

from tests import redis_servers
from tests.helpers import keys_for, rand_blocks
from tests.redis_servers import need_redis
from tierkv.ops.cli import main

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


def _written_through(c, n: int, timeout: float = 30.0) -> float:
    """Seconds until the daemon has written ``n`` blocks to the remote tier."""
    t0 = time.perf_counter()
    while c.stats()["tiers"]["remote"]["puts"] < n:
        assert time.perf_counter() - t0 < timeout, c.stats()["tiers"]["remote"]
        time.sleep(0.02)
    return time.perf_counter() - t0


def _assert_paced(c, elapsed: float, rate: float) -> None:
    link = c.stats()["transfer"]["links"]["host<->remote"]
    assert link["rate"] == rate and link["bytes"] > 0 and link["wait_s"] > 0, link
    sent = c.stats()["tiers"]["remote"]["bytes_in"]
    burst = max(64 << 10, rate * 0.05)
    assert elapsed >= (sent - burst) / rate * 0.8, (elapsed, sent)


@need_redis
def test_host_remote_budget_paces_write_through(daemon_factory, redis_server):
    rate = 256e3
    d = daemon_factory(["--remote", redis_server.url, "--remote-admission", "all"],
                       env={"TIERKV_BUDGET_HOST_REMOTE": "256KB"})
    with d.client() as c:
        keys = keys_for(c, 64, seed=7)  # 512 KiB raw: about 1.5 s at 256 KB/s once encoded
        t0 = time.perf_counter()
        c.put(keys, rand_blocks(64, seed=7))
        elapsed = time.perf_counter() - t0 + _written_through(c, 64)
        _assert_paced(c, elapsed, rate)


@need_redis
def test_host_remote_budget_is_tunable(daemon_factory, redis_server):
    d = daemon_factory(["--remote", redis_server.url, "--remote-admission", "all"])
    r = CliRunner().invoke(main, ["tune", "--socket", d.socket, "budget.host_remote=256KB"])
    assert r.exit_code == 0, r.output
    with d.client() as c:
        keys = keys_for(c, 64, seed=8)
        t0 = time.perf_counter()
        c.put(keys, rand_blocks(64, seed=8))
        elapsed = time.perf_counter() - t0 + _written_through(c, 64)
        _assert_paced(c, elapsed, 256e3)

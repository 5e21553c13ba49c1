"""Asynchronous fetch, prefetch, the cost model and link budgets, on a live daemon."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

import tierkv
from tests.helpers import keys_for, rand_blocks

BIG = tierkv.Layout(4, 4, 64, 16, "bfloat16")  # 64 KiB blocks


def _on_disk_only(d, n: int, seed: int, extra: list[str] | None = None, env: dict | None = None):
    """Store n blocks durably, restart so they are on disk only; returns (keys, blocks)."""
    with d.client(layout=BIG) as c:
        keys = keys_for(c, n, seed=seed)
        blocks = rand_blocks(n, BIG, seed=seed)
        c.put(keys, blocks, durable=True)
    d.stop()
    if env:
        d.env.update(env)
    d.start(extra)
    return keys, blocks


def test_prefetch_then_lookup_shows_ready(daemon):
    keys, blocks = _on_disk_only(daemon, 16, seed=1)
    with daemon.client(layout=BIG) as c:
        plan = c.lookup_plan(keys)
        assert plan["count"] == 16 and plan["ready"] == [False] * 16 and set(plan["tiers"]) == {"disk"}
        t0 = time.perf_counter()
        assert c.prefetch(keys) == 16
        assert time.perf_counter() - t0 < 5  # returns at once (the loads go on behind it)
        deadline = time.time() + 20
        while time.time() < deadline and not all(c.lookup_plan(keys)["ready"]):
            time.sleep(0.05)
        assert c.lookup_plan(keys)["ready"] == [True] * 16
        assert torch.equal(c.get(keys).view(torch.int16), blocks.view(torch.int16))


def test_wait_returns_partial_prefix_on_timeout(daemon):
    keys, blocks = _on_disk_only(daemon, 8, seed=2, env={"TIERKV_FAULTS": "read:sleep=0.5"})
    with daemon.client(layout=BIG) as c:
        ticket = c.fetch(keys)
        with c.wait(ticket, timeout=0.05) as lease:
            assert lease.count < 8  # a short prefix is a normal result, not an error
            for i, v in enumerate(lease.views):
                assert torch.equal(v.view(torch.int16), blocks[i].view(torch.int16))
        with c.wait(c.fetch(keys), timeout=None) as lease:  # the rest kept loading behind the timeout
            assert lease.count == 8
        assert c.stats()["leases"] == 0


def test_cost_model_picks_recompute_for_a_slow_tier(daemon):
    keys, blocks = _on_disk_only(daemon, 8, seed=3, env={"TIERKV_FAULTS": "read:sleep=0.3"})
    with daemon.client(layout=BIG) as c:
        for i in range(4):  # the daemon measures the slow tier as it serves
            c.get(keys[i:i + 1])
            c.delete(keys[i:i + 1])
        # the engine reports a fast prefill: 16,000 tokens/s
        c.report_recompute(16 * 100, 0.1)
        plan = c.lookup_plan(keys[4:])
        assert plan["count"] == 4 and plan["fetch"] == 0
        assert c.get_prefix(keys[4:]).shape[0] == 0  # recomputing beats fetching: nothing is loaded
        for _ in range(40):  # now a very slow engine (a moving average: it takes a few reports)
            c.report_recompute(16, 100.0)
        assert c.lookup_plan(keys[4:])["fetch"] == 4
        got = c.get_prefix(keys[4:])
        assert torch.equal(got.view(torch.int16), blocks[4:].view(torch.int16))


def test_a_plan_gives_the_recompute_time_of_every_asked_block_held_or_not(daemon):
    """Blocks no local tier holds (another node's, in the remote tier) still cost their recompute: the
    plan's ``prefix_recompute_s`` covers every key asked, and says whether the speed is measured."""
    keys, _ = _on_disk_only(daemon, 4, seed=4)
    others = [bytes([200 + i]) * len(keys[0]) for i in range(6)]
    with daemon.client(layout=BIG) as c:
        plan = c.lookup_plan(keys + others)
        curve = plan["prefix_recompute_s"]
        assert plan["count"] == 4 and len(curve) == 10 and plan["recompute_source"] == "prior"
        assert all(0 < a < b for a, b in zip(curve, curve[1:]))
        assert curve[-1] > 10 / 4 * curve[3] * 0.99  # ten blocks cost at least 10/4 of four
        for _ in range(3):
            c.report_recompute(1000, 1.0)
        plan = c.lookup_plan(keys + others)
        assert plan["recompute_source"] == "measured"
        assert plan["prefix_recompute_s"][0] == pytest.approx(BIG.block_tokens / 1000, rel=0.05)


def test_loads_overtake_queued_stores(daemon):
    keys, blocks = _on_disk_only(daemon, 4, seed=4, env={"TIERKV_FAULTS": "write:sleep=1.5"})
    done = {}

    def writer():
        with daemon.client(layout=BIG) as w:
            k = keys_for(w, 32, seed=40)
            w.put(k, rand_blocks(32, BIG, seed=40), durable=True)  # slow: each write batch sleeps
            done["store"] = time.perf_counter()

    t = threading.Thread(target=writer)
    t.start()
    time.sleep(0.3)
    with daemon.client(layout=BIG) as c:
        got = c.get(keys)  # a load from disk does not queue behind the stores
        done["load"] = time.perf_counter()
    t.join()
    assert torch.equal(got.view(torch.int16), blocks.view(torch.int16))
    assert done["load"] < done["store"]


def test_budget_limits_disk_writes(daemon):
    from click.testing import CliRunner

    from tierkv.ops.cli import main

    r = CliRunner().invoke(main, ["tune", "--socket", daemon.socket, "budget.host_disk=4MB"])
    assert r.exit_code == 0, r.output
    with daemon.client(layout=BIG) as c:
        keys = keys_for(c, 128, seed=5)  # 8 MiB of raw bytes
        t0 = time.perf_counter()
        c.put(keys, rand_blocks(128, BIG, seed=5), durable=True)
        elapsed = time.perf_counter() - t0
        link = c.stats()["transfer"]["links"]["host<->disk"]
    stored = link["bytes"]
    assert stored > 0
    # the bucket starts with a 50 ms burst; the rest flows at 4 MB/s (within 10%)
    assert elapsed >= (stored - 0.2e6) / 4e6 * 0.9


def test_paged_store_and_load_round_trip(daemon):
    L, H, T, D = 2, 2, 16, 32  # the SMALL layout of the other tests
    layout = tierkv.Layout(L, H, D, T, "bfloat16")
    g = torch.Generator().manual_seed(7)
    k_cache = [torch.randn(10, T, H, D, generator=g).to(torch.bfloat16) for _ in range(L)]
    v_cache = [torch.randn(10, T, H, D, generator=g).to(torch.bfloat16) for _ in range(L)]
    with daemon.client(layout=layout) as c:
        keys = keys_for(c, 3, seed=8)
        assert c.store_paged(keys, k_cache, v_cache, [7, 2, 5]) == 3
        k2 = [torch.zeros_like(x) for x in k_cache]
        v2 = [torch.zeros_like(x) for x in v_cache]
        assert c.load_paged(keys, k2, v2, [0, 1, 9]) == 3
        for src, dst in ((7, 0), (2, 1), (5, 9)):
            for layer in range(L):
                assert torch.equal(k2[layer][dst], k_cache[layer][src])
                assert torch.equal(v2[layer][dst], v_cache[layer][src])
        blk = c.get(keys[:1])[0]  # tierkv's own layout: [2, L, H, T, D]
        assert torch.equal(blk[0, 1], k_cache[1][7].permute(1, 0, 2))


@contextlib.contextmanager
def _every_core_spinning(cores: int) -> Iterator[None]:
    """One spinning process per core (an engine that leaves none idle) until the block ends."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        time.sleep(1.5)  # the daemon has seen the busy cores
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait()


@pytest.mark.exclusive
def test_write_behind_waits_while_the_engine_keeps_the_cores_busy_and_a_durable_put_does_not(daemon_factory):
    cores = os.cpu_count() or 1
    d = daemon_factory(["--host-capacity", "8MiB", "--slab-bytes", "1MiB"],
                       env={"TIERKV_DISK_ADMISSION": "all", "TIERKV_HOST_WRITE_BEHIND_IDLE_CORES": str(cores - 0.5)})
    with _every_core_spinning(cores):
        with d.client() as c:  # 8 KiB blocks: 1,024 host slots
            keys, blocks = keys_for(c, 800, seed=12), rand_blocks(800, seed=12)
            c.put(keys, blocks)
            time.sleep(2.0)  # the evictor asks at least every half second
            st = c.stats()["tiers"]
            assert st["disk"]["write_behind_waits"] >= 2 and st["disk"]["written_behind"] == 0
            assert st["disk"]["blocks"] == 0 and st["host"]["blocks"] == 800
            # a durable put does not wait for idle cores: its own write goes ahead of the deferred ones
            more, more_blocks = keys_for(c, 40, seed=14), rand_blocks(40, seed=14)
            t0 = time.monotonic()
            c.put(more, more_blocks, durable=True, timeout=30)
            assert time.monotonic() - t0 < 30 and c.lookup_tiers(more)[:1] == ["host"]
            assert c.stats()["tiers"]["disk"]["blocks"] >= 40 and c.stats()["tiers"]["disk"]["written_behind"] == 0
    with d.client() as c:  # the cores idle again: write-behind goes on
        deadline = time.time() + 30
        while time.time() < deadline and c.stats()["tiers"]["disk"]["blocks"] < 700:
            time.sleep(0.05)
        assert c.stats()["tiers"]["disk"]["written_behind"] >= 700
        assert torch.equal(c.get(keys[:100]).view(torch.int16), blocks[:100].view(torch.int16))


@pytest.mark.exclusive
def test_write_behind_goes_on_paced_while_the_engine_is_busy_and_stores_drop_unwritten_blocks(daemon_factory):
    cores = os.cpu_count() or 1
    d = daemon_factory(["--host-capacity", "8MiB", "--slab-bytes", "1MiB"],
                       env={"TIERKV_DISK_ADMISSION": "all", "TIERKV_HOST_WRITE_BEHIND_IDLE_CORES": str(cores - 0.5)})
    with _every_core_spinning(cores):
        with d.client() as c:  # 8 KiB blocks: 1,024 host slots; bursts that never wait drop unwritten ones
            keys, blocks = keys_for(c, 4000, seed=13), rand_blocks(4000, seed=13)
            deadline, i = time.time() + 40, 0
            while time.time() < deadline and i < 4000 and c.stats()["tiers"]["disk"]["written_behind"] == 0:
                c.put(keys[i:i + 200], blocks[i:i + 200], timeout=0)
                i += 200
                time.sleep(0.5)
            st = c.stats()["tiers"]
            assert st["host"]["dropped_unwritten"] > 0 and st["disk"]["write_behind_waits"] >= 1
            assert st["disk"]["written_behind"] > 0


def test_write_behind_cleans_cold_blocks_so_stores_need_not_wait(daemon_factory):
    # write-behind on an idle engine whatever else the machine runs (the busy engine's deferral: above)
    d = daemon_factory(["--host-capacity", "8MiB", "--slab-bytes", "1MiB"],
                       env={"TIERKV_DISK_ADMISSION": "all", "TIERKV_HOST_WRITE_BEHIND_IDLE_CORES": "0"})
    with d.client() as c:  # 8 KiB blocks: 1,024 host slots
        keys, blocks = keys_for(c, 1400, seed=11), rand_blocks(1400, seed=11)
        c.put(keys[:800], blocks[:800])
        deadline = time.time() + 30
        while time.time() < deadline and c.stats()["tiers"]["disk"]["blocks"] < 700:
            time.sleep(0.05)
        st = c.stats()["tiers"]
        # written ahead of eviction: on disk and still in host memory
        assert st["disk"]["written_behind"] >= 700 and st["host"]["blocks"] == 800 and st["host"]["evictions"] == 0
        c.put(keys[800:], blocks[800:])  # past capacity: clean blocks are evicted, no write in the way
        st = c.stats()["tiers"]
        assert st["host"]["evictions"] >= 400 - 224 and st["host"]["used_bytes"] <= 8 << 20
        assert c.lookup(keys) == 1400
        for i in range(0, 1400, 350):  # leases must fit the 8 MiB host tier
            assert torch.equal(c.get(keys[i:i + 350]).view(torch.int16), blocks[i:i + 350].view(torch.int16))

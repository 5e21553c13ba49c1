"""Loads beside the forward pass and stores that never wait, through the vLLM connector's plain parts
against a real daemon: a prefix only on disk loads asynchronously and exactly; a stalled disk or a
killed daemon ends the load within its bound (vLLM recomputes); requests sharing a prefix read it from
disk once; a queued request's prefix is prefetched within the daemon's budget; a store into a full
host tier returns without waiting for the disk writer."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tierkv
from tests.helpers import wait_for
from tests.integrations.test_vllm_plan import BT, LAYOUT, Cached, Req, Step, link, pages, prefill
from tierkv.core.keys import Namespace, chain_keys
from tierkv.integrations.vllm.committer import StoreCommitter
from tierkv.integrations.vllm.meter import ASYNC_WAIT_MAX_S, ASYNC_WAIT_MIN_S
from tierkv.integrations.vllm.pages import VllmPages
from tierkv.integrations.vllm.plan import BlockIO, PlanGroup, Planner, PrefillMeter
from tierkv.integrations.vllm.transfer import Transfers

NS = Namespace("vllm-plan", LAYOUT)
TOKENS = list(range(3000, 3000 + 4 * BT + 3))  # 4 full blocks and a partial one


def _on_disk_only(daemon, tokens: list[int] = TOKENS, env: dict[str, str] | None = None):
    """Store the prompt's blocks from a first request, then restart the daemon (SIGTERM flushes the host
    tier to disk), so the blocks are on disk and in no host slot. Returns the source pages."""
    src = pages(seed=11)
    _, plan = prefill(Planner.single(link(daemon), NS, BT), Req("first", tokens), [0, 1, 2, 3, 4])
    Transfers(link(daemon), src).store(plan.stores)
    daemon.stop()
    daemon.env.update(env or {})
    daemon.start()
    assert daemon.stats()["tiers"]["host"]["blocks"] == 0
    return src


def _measured(daemon, tokens_per_s: float) -> None:
    """The engine reports its prefill speed, as the connector's meter does, until the daemon's cost
    model counts it as measured."""
    for _ in range(3):
        link(daemon).call(lambda c: c.report_recompute(int(tokens_per_s), 1.0))


def _park(planner: Planner, req: Req, block_ids: list[int]) -> BlockIO:
    """The scheduler's part for a request whose prefix is on disk: an asynchronous load, sent with the
    next step."""
    n, asynchronous = planner.matched_tokens(req, 0)
    assert n == 4 * BT and asynchronous
    planner.allocated(req, (block_ids,), n)
    (io,) = planner.step(Step([], Cached(), {})).loads
    assert io.wait_s is not None and io.block_ids == block_ids[:4]
    return io


def _done(t: Transfers, timeout: float = 30.0) -> tuple[set[str], set[int], float]:
    """Poll as vLLM does each step until a request is reported: (done, load errors, seconds taken)."""
    t0 = time.monotonic()
    done: set[str] = set()
    while not done and time.monotonic() - t0 < timeout:
        done = t.take_done()
        time.sleep(0.01)
    return done, t.take_load_errors(), time.monotonic() - t0


def test_a_prefix_only_on_disk_loads_asynchronously_and_exactly(daemon):
    src = _on_disk_only(daemon)
    planner = Planner.single(link(daemon), NS, BT)
    io = _park(planner, Req("second", TOKENS), [9, 10, 11, 12, 13])
    dst = pages(seed=12)
    t = Transfers(link(daemon), dst, async_link=link(daemon))
    t.start_async([io])
    done, errors, _ = _done(t)
    assert done == {"second"} and not errors
    for a, b in zip([0, 1, 2, 3], [9, 10, 11, 12]):
        assert all(torch.equal(s[a], d[b]) for s, d in zip(src.caches, dst.caches))
    c = t.take_counters()
    assert c.hit_tokens == c.async_hit_tokens == 4 * BT and c.async_loads == 1 and c.load_s == 0.0
    assert c.load_steps == 0  # nothing loaded inside a step


def _restarted(daemon) -> None:
    """A park started promoting the prefix: restart so that it is on disk only again."""
    daemon.stop()
    daemon.start()
    assert daemon.stats()["tiers"]["host"]["blocks"] == 0


class _HeldPages(VllmPages):
    """Pages whose copies wait for ``release``: a copy into vLLM's pages that takes its time."""

    def __init__(self, base: VllmPages) -> None:
        super().__init__(base.caches, 32)
        self.copying, self.release = threading.Event(), threading.Event()

    def scatter(self, blocks, block_ids) -> None:
        self.copying.set()
        assert self.release.wait(30)
        super().scatter(blocks, block_ids)


def test_the_step_never_waits_for_an_asynchronous_copy_into_vllms_pages(daemon):
    src = _on_disk_only(daemon)
    planner = Planner.single(link(daemon), NS, BT)
    io = _park(planner, Req("slow", TOKENS), [9, 10, 11, 12, 13])
    io.wait_s = 0.2  # a copy still running past its bound and grace is not given up
    dst = _HeldPages(pages(seed=12))
    t = Transfers(link(daemon), dst, async_link=link(daemon))
    t.start_async([io])
    assert dst.copying.wait(30)
    time.sleep(1.5)
    t0 = time.monotonic()
    assert t.take_done() == set() and not t.take_load_errors()  # the step goes on
    assert time.monotonic() - t0 < 5.0
    dst.release.set()
    done, errors, _ = _done(t)
    assert done == {"slow"} and not errors
    for a, b in zip([0, 1, 2, 3], [9, 10, 11, 12]):
        assert all(torch.equal(s[a], d[b]) for s, d in zip(src.caches, dst.caches))


def test_the_bound_is_the_ceiling_until_the_prefill_speed_is_measured_then_the_recompute_time(daemon):
    """A fresh engine's daemon knows no prefill speed: a guessed one could cut a load that beats
    recomputing, so the load may take the ceiling; a scheduler that measured the engine itself (the
    daemon restarted) bounds it by that speed. Once the daemon has the speed, the bound is what
    recomputing the prefix would take by its cost model (within the floor and ceiling)."""
    _on_disk_only(daemon)
    planner = Planner.single(link(daemon), NS, BT)
    assert _park(planner, Req("fresh", TOKENS), [0, 1, 2, 3, 4]).wait_s == ASYNC_WAIT_MAX_S
    _restarted(daemon)
    now = [0.0]
    meter = PrefillMeter(lambda tokens, seconds: None, min_tokens=1, clock=lambda: now[0])
    meter.step({"r": 100})
    now[0] = 2.0
    meter.step({"r": 1})  # 100 tokens in 2 s, not reported to the daemon
    assert meter.tokens_per_s() == 50.0
    planner = Planner([PlanGroup(link(daemon), NS)], BT, meter=meter)
    assert _park(planner, Req("metered", TOKENS), [0, 1, 2, 3, 4]).wait_s == pytest.approx(4 * BT / 50.0)
    _restarted(daemon)
    planner = Planner.single(link(daemon), NS, BT)
    _measured(daemon, tokens_per_s=50)  # 4 blocks of 32 tokens: ~2.6 s to recompute
    keys = chain_keys(NS.fingerprint, TOKENS[:4 * BT], BT, None)
    plan = link(daemon).call(lambda c: c.lookup_plan(keys))
    assert plan["recompute_source"] == "measured"
    io = _park(planner, Req("slow", TOKENS), [5, 6, 7, 8, 9])
    assert io.wait_s == pytest.approx(plan["prefix_recompute_s"][3])
    assert ASYNC_WAIT_MIN_S < io.wait_s < ASYNC_WAIT_MAX_S


def test_a_prefix_in_host_memory_longer_than_the_sync_limit_loads_beside_the_step_and_exactly(daemon):
    """Up to ``sync_load_blocks`` a prefix in host memory is copied inside the step; a longer one loads
    beside it (its copy would stall every request of the batch), the same bytes."""
    src = pages(seed=17)
    _, plan = prefill(Planner.single(link(daemon), NS, BT), Req("first", TOKENS), [0, 1, 2, 3, 4])
    Transfers(link(daemon), src).store(plan.stores)
    assert Planner([PlanGroup(link(daemon), NS)], BT, sync_load_blocks=4).matched_tokens(
        Req("short", TOKENS), 0) == (4 * BT, False)
    io = _park(Planner([PlanGroup(link(daemon), NS)], BT, sync_load_blocks=3), Req("long", TOKENS),
               [9, 10, 11, 12, 13])
    dst = pages(seed=18)
    t = Transfers(link(daemon), dst, async_link=link(daemon))
    t.start_async([io])
    done, errors, _ = _done(t)
    assert done == {"long"} and not errors
    for a, b in zip([0, 1, 2, 3], [9, 10, 11, 12]):
        assert all(torch.equal(s[a], d[b]) for s, d in zip(src.caches, dst.caches))


def test_a_stalled_disk_ends_the_load_within_its_bound_and_vllm_recomputes(daemon):
    _on_disk_only(daemon, env={"TIERKV_FAULTS": "read:sleep=30"})
    _measured(daemon, tokens_per_s=10_000)  # the bound: the floor
    planner = Planner.single(link(daemon), NS, BT)
    io = _park(planner, Req("stalled", TOKENS), [5, 6, 7, 8, 9])
    dst = pages(seed=13)
    before = [c.clone() for c in dst.caches]
    t = Transfers(link(daemon), dst, async_link=link(daemon))
    t.start_async([io])
    done, errors, took = _done(t)
    assert done == {"stalled"} and errors == {5, 6, 7, 8}
    assert took < io.wait_s + 5.0  # the bound, not the disk's 30 s
    assert all(torch.equal(b, c) for b, c in zip(before, dst.caches))  # nothing half-written
    daemon.kill()


def test_a_daemon_killed_during_an_asynchronous_load_ends_it_at_once(daemon):
    _on_disk_only(daemon, env={"TIERKV_FAULTS": "read:sleep=30"})
    planner = Planner.single(link(daemon), NS, BT)
    io = _park(planner, Req("killed", TOKENS), [1, 2, 3, 4, 5])
    io.wait_s = 60.0  # a long bound: only the lost connection can end it early
    t = Transfers(link(daemon), pages(seed=14), async_link=link(daemon))
    t.start_async([io])
    time.sleep(0.5)
    daemon.kill()
    done, errors, took = _done(t, timeout=20.0)
    assert done == {"killed"} and errors == {1, 2, 3, 4} and took < 10.0


def test_a_daemon_that_stops_answering_is_given_up_after_the_bound(daemon):
    _on_disk_only(daemon, env={"TIERKV_FAULTS": "read:sleep=30"})
    planner = Planner.single(link(daemon), NS, BT)
    io = _park(planner, Req("frozen", TOKENS), [1, 2, 3, 4, 5])
    io.wait_s = 0.5
    t = Transfers(link(daemon), pages(seed=15), async_link=link(daemon))
    daemon.proc.send_signal(19)  # SIGSTOP: the socket stays open and nothing answers
    try:
        t.start_async([io])
        done, errors, took = _done(t, timeout=20.0)
    finally:
        daemon.proc.send_signal(18)  # SIGCONT
    assert done == {"frozen"} and errors == {1, 2, 3, 4} and took < 5.0
    daemon.kill()


def test_requests_sharing_a_prefix_read_it_from_disk_once(daemon):
    src = _on_disk_only(daemon)
    planner = Planner.single(link(daemon), NS, BT)
    a = _park(planner, Req("a", TOKENS), [0, 1, 2, 3, 4])
    b = BlockIO("b", a.keys, [5, 6, 7, 8], a.wait_s)  # the same prefix, parked in the same step
    dst = pages(seed=16)
    t = Transfers(link(daemon), dst, async_link=link(daemon))
    t.start_async([a, b])
    done: set[str] = set()
    deadline = time.monotonic() + 30
    while done != {"a", "b"} and time.monotonic() < deadline:
        done |= t.take_done()
        time.sleep(0.01)
    assert done == {"a", "b"} and not t.take_load_errors()
    for first in (0, 5):
        assert all(torch.equal(s[i], d[first + i]) for s, d in zip(src.caches, dst.caches) for i in range(4))
    assert daemon.stats()["tiers"]["disk"]["hits"] == 4  # each block read from disk once


def test_a_queued_request_is_prefetched_within_the_budget(daemon):
    _on_disk_only(daemon)
    planner = Planner.single(link(daemon), NS, BT)
    assert planner.queued(Req("queued", TOKENS)) == 4
    assert wait_for(lambda: daemon.stats()["tiers"]["host"]["blocks"] == 4, timeout=30)
    assert daemon.stats()["tiers"]["host"]["prefetches"] == 4
    n, asynchronous = planner.matched_tokens(Req("queued", TOKENS), 0)
    assert (n, asynchronous) == (4 * BT, False)  # in host memory now: loaded inside the step


def test_prefetch_holds_at_most_its_share_of_the_host_tier(daemon_factory):
    d = daemon_factory(["--host-capacity", "2MiB", "--slab-bytes", "1MiB"])
    tokens = list(range(40 * BT + 1))
    src = pages(num_blocks=64, seed=17)
    _, plan = prefill(Planner.single(link(d), NS, BT), Req("long", tokens), list(range(41)))
    Transfers(link(d), src).store(plan.stores)
    d.stop()
    d.start()
    planner = Planner.single(link(d), NS, BT)
    started = planner.queued(Req("q", tokens))
    assert 0 < started <= int(0.25 * (2 << 20)) // (32 << 10)  # a quarter of the tier, 32 KiB blocks
    assert planner.queued(Req("q2", tokens)) == 0  # none used yet: the budget is spent


def test_a_store_into_a_full_host_tier_never_waits_for_the_disk_writer(daemon_factory):
    """A slow disk writer (2 s a write) and a host tier full of blocks it has not written: the store
    makes room by dropping unwritten blocks and returns without waiting for the writer."""
    d = daemon_factory(["--host-capacity", "16MiB", "--slab-bytes", "1MiB"], env={"TIERKV_FAULTS": "write:sleep=2"})
    lay = tierkv.Layout(2, 2, 64, 64, "float32")  # 128 KiB blocks: about 120 fill the tier
    with d.client(model="burst", layout=lay) as c:
        keys = c.block_keys(list(range(192 * 64)))
        blocks = torch.randn(lay.batch_shape(192), dtype=torch.float32)
        c.put(keys[:96], blocks[:96], timeout=0)
        t0 = time.monotonic()
        for i in range(96, 192, 16):
            c.put(keys[i:i + 16], blocks[i:i + 16], timeout=0)
        took = time.monotonic() - t0
        assert took < 2.0, took  # six bursts, each would wait for a 2 s write
        assert c.lookup(keys[176:]) == 16
        assert c.stats()["tiers"]["host"]["dropped_unwritten"] > 0
    d.kill()  # a drain would flush the dirty blocks at 2 s a write


def test_the_connectors_store_pass_never_waits_and_is_counted(daemon_factory):
    d = daemon_factory(["--host-capacity", "4MiB", "--slab-bytes", "1MiB"], env={"TIERKV_FAULTS": "write:sleep=2"})
    src = pages(num_blocks=128, seed=18)
    planner = Planner.single(link(d), NS, BT)
    t = Transfers(link(d), src)
    t0 = time.monotonic()
    for r in range(12):  # 12 x 16 blocks of 32 KiB into a tier of about 120
        tokens = list(range(r * 100_000, r * 100_000 + 16 * BT + 1))
        _, plan = prefill(planner, Req(f"s{r}", tokens), list(range(16 * r % 112, 16 * r % 112 + 17)))
        t.store(plan.stores)
    assert time.monotonic() - t0 < 2.0
    c = t.take_counters()
    assert c.store_steps == 12 and c.store_max_s > 0 and c.store_errors == 0
    assert c.stored_tokens + c.store_skipped * BT == 12 * 16 * BT
    d.kill()  # a drain would flush the dirty blocks at 2 s a write


def test_the_prefill_meter_reports_contiguous_prefill_steps_only():
    seen: list[tuple[int, float]] = []
    now = [0.0]
    m = PrefillMeter(lambda tok, sec: seen.append((tok, sec)), min_tokens=256, every_s=5.0, clock=lambda: now[0])
    for tokens, dt in ((1000, 0.5), (1000, 0.5), (1, 0.1)):
        m.step({"r": tokens})
        now[0] += dt
    m.step({"other": 512})  # after an idle gap (no request carried over): not counted
    now[0] += 100.0
    m.step({"r2": 1})
    now[0] = 6.0
    m.step({"r2": 1})
    assert seen == [(2000, 1.0)]


@pytest.mark.gpu
def test_an_asynchronous_load_into_cuda_pages_runs_on_a_side_stream(daemon):
    """CUDA pages: the load thread copies on its own stream and the blocks land exactly."""
    src = _on_disk_only(daemon)
    planner = Planner.single(link(daemon), NS, BT)
    io = _park(planner, Req("cuda", TOKENS), [2, 3, 4, 5, 6])
    dev = torch.device("cuda")
    caches = [torch.zeros(16, 2, BT, 64, device=dev) for _ in range(2)]
    t = Transfers(link(daemon), VllmPages(caches, 32), async_link=link(daemon))
    assert t.asyncs is not None and t.asyncs._stream is not None
    t.start_async([io])
    done, errors, _ = _done(t)
    assert done == {"cuda"} and not errors
    torch.cuda.synchronize()
    for layer, c in enumerate(caches):
        for a, b in zip([0, 1, 2, 3], [2, 3, 4, 5]):
            # the CPU pages keep K transposed; compare through the tierkv block both sides map to
            ref = [torch.empty(LAYOUT.block_shape)]
            src.gather([a], ref)
            assert torch.equal(c[b, :, :, :32].cpu(), ref[0][0, layer])
            assert torch.equal(c[b, :, :, 32:].cpu(), ref[0][1, layer])


def test_a_request_whose_asynchronous_load_ended_short_never_waits_again(daemon):
    """vLLM asks again for a request whose load failed; it gets only what is in host memory now."""
    _on_disk_only(daemon, env={"TIERKV_FAULTS": "read:sleep=30"})
    planner = Planner.single(link(daemon), NS, BT)
    req = Req("short", TOKENS)
    _park(planner, req, [1, 2, 3, 4, 5])
    assert planner.matched_tokens(req, 0) == (0, False)  # still on the stalled disk: recompute
    daemon.kill()


def test_stores_behind_the_step_commit_on_their_own_thread_from_slots_allocated_ahead(daemon):
    """With a committer the step copies into slots taken from a reservoir; commits follow on the
    committer's thread, and a second request loads exactly what the first stored."""
    src = pages(seed=19)
    committer = StoreCommitter(link(daemon), BT)
    t = Transfers(link(daemon), src, committer=committer)
    planner = Planner.single(link(daemon), NS, BT)
    tokens = list(range(9000, 9000 + 4 * BT + 1))
    _, plan = prefill(planner, Req("w1", tokens), [0, 1, 2, 3, 4])
    t.store(plan.stores)
    assert committer.flush()
    assert len(committer._free) == 4  # refilled for a next step of the same size
    c = t.take_counters()
    assert c.stored_tokens == 4 * BT and c.new_blocks == 4 and c.store_steps == 1
    n, plan = prefill(planner, Req("w2", tokens), [5, 6, 7, 8, 9])
    assert n == 4 * BT
    dst = pages(seed=20)
    Transfers(link(daemon), dst).load(plan.loads)
    for a, b in zip([0, 1, 2, 3], [5, 6, 7, 8]):
        assert all(torch.equal(s[a], d[b]) for s, d in zip(src.caches, dst.caches))
    other = list(range(20_000, 20_000 + 2 * BT + 1))
    _, plan = prefill(planner, Req("w3", other), [10, 11, 12])
    t.store(plan.stores)  # two of the four reserved slots
    assert committer.flush() and t.take_counters().stored_tokens == 2 * BT
    committer.close()


def test_a_committer_whose_daemon_restarts_drops_its_reservoir_and_goes_on(daemon):
    committer = StoreCommitter(link(daemon), BT)
    t = Transfers(link(daemon), pages(seed=21), committer=committer)
    planner = Planner.single(link(daemon), NS, BT)
    _, plan = prefill(planner, Req("r1", list(range(4 * BT + 1))), [0, 1, 2, 3, 4])
    t.store(plan.stores)
    assert committer.flush()
    daemon.kill()
    daemon.start()
    committer.link._next_try = 0.0
    _, plan = prefill(Planner.single(link(daemon), NS, BT), Req("r2", list(range(7, 7 + 4 * BT + 1))), [0, 1, 2, 3, 4])
    for _ in range(3):  # the first store after the restart may find the old connection broken
        t.store(plan.stores)
        committer.link._next_try = 0.0
    assert committer.flush()
    assert daemon.stats()["tiers"]["host"]["blocks"] == 4
    committer.close()

"""The store gate: a stream without reuse stops being stored within a bounded number of offers, one
with reuse keeps being stored, one that turns to reuse is stored again; what is stored is always a
leading run of a request's blocks; costs set the bar."""

from __future__ import annotations

import pytest

from tierkv.cache.store_gate import BlockCosts, StoreGate, bucket

CHEAP = BlockCosts(recompute_s=lambda pos: 0.1, store_s=0.001)  # storing costs 1% of recomputing


def unique(i: int, n: int) -> list[str]:
    return [f"r{i}.b{j}" for j in range(n)]


def test_position_buckets_double():
    assert [bucket(p) for p in (0, 1, 2, 3, 4, 7, 8, 127, 128, 10**6)] == [0, 1, 2, 2, 3, 3, 4, 7, 8, 8]


def test_a_stream_without_reuse_stops_being_stored_within_a_bounded_number_of_requests():
    g = StoreGate()
    stored = [g.offer("ns", unique(i, 6), 0, CHEAP) for i in range(60)]
    assert stored[0] == 6  # nothing known yet: the prior says store
    # p = prior * w / (n + w) falls under min_return (0.05) after w * (prior / 0.05 - 1) = 5 offers of a
    # bucket: deeper buckets (two positions a request) first, the first one from the seventh request on
    assert stored[:3] == [6] * 3 and stored[3:6] == [2] * 3 and all(n == 0 for n in stored[6:])
    g3 = StoreGate(prior_weight=3.0)  # store.prior_weight: 15 offers of a bucket
    heavier = [g3.offer("ns", unique(i, 6), 0, CHEAP) for i in range(60)]
    assert heavier[:8] == [6] * 8 and heavier[8:16] == [2] * 8 and all(n == 0 for n in heavier[16:])
    assert g.c.offered == 360 and g.c.stored == sum(stored) and g.c.skipped == 360 - sum(stored)
    assert g.c.returns == 0


def test_an_idle_engine_stores_a_longer_run_that_also_ends_without_reuse():
    """``decide`` says what to store now and what an idle engine stores when the request ends: the idle
    run weighs the prior as ``idle_prior_weight`` (3 by default) and ends as a stream without reuse goes
    on, 15 offers of a bucket in; 0 turns it off."""
    g, same = StoreGate(), StoreGate()
    pairs = [g.decide("ns", unique(i, 6), 0, CHEAP) for i in range(60)]
    assert [now for now, _ in pairs] == [same.offer("ns", unique(i, 6), 0, CHEAP) for i in range(60)]
    idle = [later for _, later in pairs]
    assert idle[:8] == [6] * 8 and idle[8:16] == [2] * 8 and all(n == 0 for n in idle[16:])
    assert g.c.idle == sum(later - now for now, later in pairs) and g.c.skipped == 360 - g.c.stored
    assert g.snapshot()["idle"] == g.c.idle
    # a request cut earlier stores nothing now; its idle run is still told (the caller continues it)
    assert StoreGate().decide("ns", unique(100, 3), 4, CHEAP, cut=True) == (0, 3)
    off = StoreGate(idle_prior_weight=0.0)
    assert all(now == later for now, later in (off.decide("ns", unique(i, 6), 0, CHEAP) for i in range(30)))
    assert StoreGate(mode="all").decide("ns", unique(1, 4), 0, CHEAP) == (4, 4)
    with pytest.raises(ValueError):
        StoreGate(idle_prior_weight=-1.0)


def test_a_stream_with_reuse_keeps_being_stored():
    g = StoreGate()
    system = [f"sys.b{j}" for j in range(4)]
    for i in range(200):
        first = 0 if i == 0 else 4  # after the first request the system prompt is cached: not offered
        keys = system + unique(i, 3) if i == 0 else unique(i, 3)
        n = g.offer("ns", keys, first, CHEAP)
        if i % 2:  # every other request's turn comes back and reads its blocks
            for k in keys[:n]:
                g.read(k)
    assert g.offer("ns", unique(999, 3), 4, CHEAP) == 3  # half of these positions come back: stored
    assert g.c.returns > 200


def test_a_stream_that_turns_to_reuse_is_stored_again_from_its_skipped_blocks():
    g = StoreGate()
    for i in range(40):
        g.offer("ns", unique(i, 4), 0, CHEAP)
    assert g.offer("ns", ["shared.b0", "shared.b1"], 0, CHEAP) == 0  # skipped: remembered as ghosts
    assert g.offer("ns", ["other.b0", "shared.b1"], 0, CHEAP) == 0, "a return after a miss is not a prefix"
    took = []
    for _ in range(10):  # the same prefix again and again: each offer is a return of the last one's
        took.append(g.offer("ns", ["shared.b0", "shared.b1"], 0, CHEAP))
    assert took == [2] * 10, "offered again, a block is stored then: its reuse is seen"
    assert g.c.returns >= 10
    dear = BlockCosts(recompute_s=lambda pos: 0.1, store_s=0.2)  # storing costs more than recomputing
    g.offer("ns", ["late.b0"], 0, dear)
    assert g.offer("ns", ["late.b0"], 0, dear) == 0, "unless storing costs more than recomputing"


def test_what_is_stored_is_a_leading_run_and_a_cut_request_only_teaches():
    g = StoreGate()
    for i in range(30):  # deep positions never come back, the first ones always do
        keys = ["head.b0", "head.b1"] + unique(i, 14)
        n = g.offer("ns", keys, 0, CHEAP)
        for k in keys[:min(n, 2)]:
            g.read(k)
    n = g.offer("ns", ["head.b0", "head.b1"] + unique(100, 14), 0, CHEAP)
    assert n == 2  # the first bucket that does not pay ends the run
    before = g.c.stored
    assert g.offer("ns", unique(101, 4), 20, CHEAP, cut=True) == 0
    assert g.c.stored == before and g.c.offered >= 30 * 16 + 16 + 4


def test_classes_learn_apart():
    g = StoreGate()
    for i in range(40):
        g.offer(("ns", b"tenant-a"), unique(i, 2), 0, CHEAP)
    assert g.offer(("ns", b"tenant-a"), unique(100, 2), 0, CHEAP) == 0
    assert g.offer(("ns", b"tenant-b"), unique(101, 2), 0, CHEAP) == 2  # nothing known of b yet


def test_costs_set_the_bar_and_all_stores_everything():
    g = StoreGate()
    for i in range(6):  # a bucket that came back 1 time in 4
        keys = unique(i, 1)
        g.offer("ns", keys, 0, CHEAP)
        if i % 4 == 0:
            g.read(keys[0])
    assert g.chance("ns", 0) == pytest.approx((2 + 0.3) / (6 + 1), abs=0.05)
    assert g.offer("ns", unique(50, 1), 0, CHEAP) == 1
    dear = BlockCosts(recompute_s=lambda pos: 0.1, store_s=0.09)  # storing costs 90% of recomputing
    assert g.offer("ns", unique(51, 1), 0, dear) == 0
    g.update(mode="all")
    assert g.offer("ns", unique(52, 3), 0, dear) == 3
    with pytest.raises(ValueError, match="mode"):
        g.update(mode="sometimes")
    with pytest.raises(ValueError):
        g.update(min_return=2.0)
    assert g.mode == "all"
    snap = g.snapshot()
    assert snap["offered"] == g.c.offered and len(snap["return_rate_by_position"]) == 9

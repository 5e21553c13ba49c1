"""The admission rule of a colder tier (tierkv/cache/admission.py): its modes, the predicted rule's
models (admission, eviction order, floor) and what they learn."""

from __future__ import annotations

import pytest

from tierkv.cache.admission import Admission


def test_the_eviction_model_learns_over_a_shorter_ghost_list():
    """The disk order's model sees every signal the admission model sees, on a ghost list
    ``evict_horizon`` times as long: a block that returns after more departures than that counts a
    miss for the eviction model and a return for the admission model."""
    rule = Admission("predicted", ghost_entries=100, evict_horizon=0.5)
    assert rule.evict_model.settings()["ghost_entries"] == 50
    rule.requested([b"late"], 0.0)
    cls = rule.model.block_class(b"late", 0.0)  # the class it leaves with
    rule.admit(b"late", 0.0)
    for i in range(70):  # 70 departures later: off the 50-entry list, still on the 100-entry one
        rule.requested([i], 1.0)
        rule.admit(i, 1.0)
    rule.requested([b"late"], 2.0)
    assert rule.model.returns == 1 and rule.evict_model.returns == 0
    assert rule.evict_model.class_p(cls) < 0.5 < rule.model.class_p(cls)
    rule.update(evict_horizon=2.0)
    assert rule.evict_model.settings()["ghost_entries"] == 200
    with pytest.raises(ValueError, match="evict_horizon"):
        rule.update(evict_horizon=0.0)
    assert rule.evict_model.settings()["ghost_entries"] == 200  # a bad value changes nothing


def test_the_floor_skips_tails_that_never_return():
    """A chain tail is not written when the floor model (a ghost list ``floor_horizon`` times as long)
    finds its class comes back less often than ``floor``, writer idle or busy; the admission model,
    whose list has not turned over yet, still holds the prior for that class. Other blocks are the
    admission model's to decide."""
    rule = Admission("predicted", ghost_entries=400, floor_horizon=0.25)
    assert rule.floor_model.settings()["ghost_entries"] == 100
    for i in range(150):
        live, dead = (b"live", i), (b"dead", i)
        rule.requested([live, (b"next", i)], float(i))  # a chain whose first block comes back
        assert rule.admit(live, float(i), spare=True)
        rule.requested([live, (b"again", i)], float(i))
        rule.requested([dead], float(i))  # a finished request's tail that no request extends
        rule.request_finished([dead], float(i))
        rule.admit(dead, float(i), spare=True)
    now, tail = 150.0, (b"dead", 150)
    rule.requested([tail], now)
    rule.request_finished([tail], now)
    assert rule.model.is_tail(tail) and not rule.model.is_tail((b"live", 149))
    assert rule.floor_model.p(tail, now) < 0.05 <= rule.model.p(tail, now)
    assert not rule.wants(tail, now, spare=True) and not rule.wants(tail, now, spare=False)
    assert rule.wants(tail, now, sharers=2)  # shared blocks are always written
    rule.requested([tail, b"turn 2"], now + 1)  # a later request extends the chain through it
    assert not rule.model.is_tail(tail) and rule.wants(tail, now + 1, spare=True)
    rule.update(floor=0.0)  # no floor: the admission model decides every victim
    assert rule.wants((b"dead", 149), now, spare=True)
    assert rule.snapshot()["floor"]["ghost"] == 100


def test_rule_learns_that_finished_tails_come_back():
    """Chains that are extended after they finish are written under pressure; a class of blocks
    that never returns is skipped once the ghost list has seen enough of it."""
    rule = Admission("predicted", ghost_entries=64, write_s=0.03)
    now = 0.0
    for i in range(200):  # one-shot chains of length 1: dropped, never requested again
        key = ("once", i)
        rule.requested([key], now)
        rule.admit(key, now)
        now += 1.0
    assert not rule.wants(("once", 999), now)
    for i in range(100):  # a conversation: each turn extends the last, whose tail was evicted
        turn = [("chat", j) for j in range(4 * i + 4)]
        rule.requested(turn, now)
        rule.request_finished(turn, now)
        for key in turn[-4:]:
            rule.admit(key, now)
        now += 1.0
    tail = [("chat", j) for j in range(404)]
    rule.requested(tail, now)
    rule.request_finished(tail, now)
    assert rule.wants(tail[-1], now)
    assert rule.wants(("once", 1000), now, spare=True)  # spare write bandwidth: every victim goes
    assert rule.wants(("once", 1001), now, pinned=True)


def test_rule_learns_which_output_lengths_come_back():
    """Documents asked about with a short answer are sent again, long generations are not: once the
    ghost list has seen both, a new block is written under pressure only for the short kind."""
    rule = Admission("predicted", ghost_entries=64, write_s=0.03)
    now = 0.0
    for i in range(150):
        for kind, out in (("short", 8), ("long", 900)):
            chain = [(kind, i, j) for j in range(4)]
            rule.requested(chain, now)
            rule.request_finished(chain, now, out)
            for key in chain:
                rule.admit(key, now)
            if kind == "short" and i % 4:  # most short-answer documents are sent again
                rule.requested(chain, now + 0.5)
            now += 1.0
    fresh = {}
    for kind, out in (("short", 8), ("long", 900)):
        fresh[kind] = chain = [(kind, "new", j) for j in range(4)]
        rule.requested(chain, now)
        rule.request_finished(chain, now, out)
    assert rule.wants(fresh["short"][1], now) and not rule.wants(fresh["long"][1], now)
    assert rule.model.class_p(rule.model.block_class(fresh["short"][1], now)) > 0.5


def test_rule_modes_and_bad_settings():
    assert Admission("all").wants("k", 0.0)
    assert not Admission("pinned").wants("k", 0.0)
    reused = Admission("reused")
    reused.requested(["k"], 0.0)
    reused.requested(["k"], 1.0)
    assert not reused.wants("k", 1.0)  # requests the rule saw are not hits: the caller counts those
    assert reused.wants("k", 1.0, hits=1) and reused.wants("k", 1.0, sharers=1)
    assert reused.wants("k", 1.0, pinned=True) and not reused.wants("k", 1.0, sharers=1, mode="pinned")
    assert Admission("predicted").wants("k", 1.0, hits=1, mode="reused")  # the remote tier's mode
    with pytest.raises(ValueError, match="admission mode"):
        Admission("sometimes")
    with pytest.raises(ValueError, match="no setting"):
        Admission(bogus=1)
    with pytest.raises(ValueError, match="admission mode"):
        reused.update(mode="never")
    assert reused.mode == "reused"

"""Each eviction policy's own behaviour, the admission rule and the shared history (the contract
every policy passes is in test_policy_contract.py)."""

from __future__ import annotations

import math
import random

import pytest

from tests.helpers import FakeClock
from tests.helpers import build_policy as build
from tierkv.cache.policy import HeapPolicy, make_policy, policy_names
from tierkv.cache.policy.base import never
from tierkv.cache.reuse import History

ALL = policy_names(oracles=True)


def test_registry_lists_every_policy():
    assert set(policy_names()) == {"lru", "lfu", "slru", "gdsf", "attention", "adaptive"}
    assert "opt" in ALL
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")
    with pytest.raises(ValueError, match="next_use"):
        make_policy("opt")


# -- behaviour of each policy ------------------------------------------------------------------

def test_lru_evicts_least_recently_used():
    pol = build("lru")
    for k in "abcd":
        pol.on_insert(k, 1)
    pol.on_access("a")
    assert pol.victims(2) == ["b", "c"]
    assert pol.victims(2, lambda k: k == "b") == ["c", "d"]


def test_lfu_keeps_frequent_blocks_and_ages():
    clock = FakeClock()
    pol = build("lfu", clock, half_life_s=10.0)
    pol.on_insert("hot", 1)
    for _ in range(8):
        pol.on_access("hot")
    pol.on_insert("cold", 1)
    assert pol.victims(1) == ["cold"]
    clock.now += 100.0   # ten half-lives: the old heat is gone
    pol.on_insert("new", 1)
    pol.on_access("new")
    assert pol.victims(2) == ["cold", "hot"]


def test_slru_scan_does_not_flush_protected():
    pol = build("slru")
    for i in range(20):          # the tier has held 22 blocks: the protected segment may hold 17
        pol.on_insert(("old", i), 1)
    for k in ("x", "y"):
        pol.on_insert(k, 1)
        pol.on_access(k)
        pol.on_access(k)          # second use: protected
    for i in range(10):          # a one-shot scan
        pol.on_insert(i, 1)
        pol.on_access(i)
    out = pol.victims(30)
    assert "x" not in out and "y" not in out
    assert pol.victims(32)[-2:] == ["x", "y"]


def test_gdsf_prefers_costly_small_blocks():
    cost = {"cheap": 1.0, "dear": 10.0}
    pol = make_policy("gdsf", clock=FakeClock(), cost_fn=lambda k, s: cost.get(k, 1.0))
    pol.on_insert("dear", 1)
    pol.on_insert("cheap", 1)
    assert pol.victims(1) == ["cheap"]
    pol.on_insert("big", 100)
    pol.on_insert("small", 1)
    assert pol.victims(1)[0] == "big"   # same cost, 100x the bytes
    level = pol.level
    pol.on_remove("big")
    assert pol.level > level or pol.victims(1) != ["big"]


def test_opt_evicts_farthest_next_use():
    future = {"soon": 1.0, "later": 5.0, "never": math.inf}
    pol = build("opt", future=future)
    for k in future:
        pol.on_insert(k, 1)
    assert pol.victims(2) == ["never", "later"]


def test_attention_evicts_tails_first():
    clock = FakeClock()
    pol = build("attention", clock)
    pol.on_insert("p", 1)
    pol.on_access("p")
    clock.now += 10
    pol.on_insert("c", 1, parent="p")
    pol.on_access("c")
    for _ in range(5):           # the child is much hotter, still the parent may not go first
        pol.on_access("c")
    pol.on_insert("other", 1)
    pol.on_access("other")
    out = pol.victims(3)
    assert out.index("c") < out.index("p")
    assert pol.victims(1, lambda k: k in ("c", "other")) is None  # p is held by its protected child
    pol.on_remove("c")
    assert pol.victims(1, lambda k: k == "other") == ["p"]


def test_a_store_that_cannot_wait_passes_a_busy_tail_to_its_parent():
    """A chain whose tail is being written: the usual walk finds nothing, the one for a store that
    cannot wait takes the parent, and still prefers a free leaf of another chain."""
    pol = build("attention", FakeClock())
    pol.on_insert("p", 1)
    pol.on_insert("c", 1, parent="p")
    assert pol.victims(1, lambda k: k == "c") is None
    assert pol.victims_past_busy(1, lambda k: k == "c") == ["p"]
    assert pol.victims_past_busy(1, lambda k: k == "p") == ["c"]  # a free leaf needs no second walk
    assert pol.victims_past_busy(1, lambda k: True) is None
    assert build("lru", FakeClock()).victims_past_busy(1) is None  # empty


def test_attention_frequency_sharers_and_mass_raise_priority():
    clock = FakeClock()
    pol = build("attention", clock)
    for k in ("a", "b", "c", "d"):
        pol.on_insert(k, 1)
        pol.on_access(k)
    for _ in range(4):
        pol.on_access("a")
    pol.on_sharers("b", 8)
    pol.on_touch("c", 20.0)
    assert pol.victims(1) == ["d"]
    base = pol.priority("d")
    assert min(pol.priority(k) for k in "abc") > base
    with pytest.raises(ValueError):
        pol.on_touch("c", -1.0)


def test_attention_miss_cost_and_runtime_update():
    clock = FakeClock()
    pol = build("attention", clock)
    pol.on_insert("shallow", 1)
    pol.on_access("shallow")
    parent = None
    for i in range(40):          # a deep chain: its tail costs more to recompute
        pol.on_insert(("deep", i), 1, parent)
        pol.on_access(("deep", i))
        parent = ("deep", i)
    assert pol.victims(1) == ["shallow"]
    pol.update(attn_double_tokens=0.0, fetch_bytes_per_s=1e9)   # cheap to fetch back: costs equal
    assert pol.settings()["fetch_bytes_per_s"] == 1e9
    with pytest.raises(ValueError):
        pol.update(beta=-1)
    with pytest.raises(ValueError):
        pol.update(freq_shape="cubic")
    costly = make_policy("attention", clock=clock, cost_fn=lambda k, s: 5.0 if k == "x" else 1.0)
    costly.on_insert("x", 1)
    costly.on_insert("y", 1)
    assert costly.victims(1) == ["y"]


@pytest.mark.parametrize("name", ["attention", "adaptive"])
def test_idle_aging_halves_a_blocks_value_per_idle_half_life(name):
    """With ``idle_aging`` a block worth twice another but idle one half-life longer ties with it;
    idle longer, it goes first."""
    clock = FakeClock()
    pol = build(name, clock, idle_aging=1.0, cost_fn=lambda k, s: 2.0 if k == "rich-old" else 1.0,
                tails_first=False, freq_cap=1.0)
    assert pol.tau == 300.0  # 1.0 x the starting mean idle time of victims
    pol.on_insert("rich-old", 1)
    clock.now += 450.0  # 1.5 half-lives later
    pol.on_insert("poor-new", 1)
    assert pol.victims(1) == ["rich-old"]  # 2 * 2^-1.5 < 1
    pol.on_access("rich-old")  # used again: its value is whole
    assert pol.victims(1) == ["poor-new"]
    assert pol.priority("rich-old") - pol.priority("poor-new") == pytest.approx(1.0)  # one half-life ahead
    with pytest.raises(ValueError):
        pol.update(idle_aging=-1.0)
    pol.update(idle_aging=0.0)  # back to the GDSF aging clock: L + value
    assert pol.tau == 0.0
    assert pol.priority("rich-old") - pol.level == pytest.approx(2 * (pol.priority("poor-new") - pol.level))
    assert pol.victims(1) == ["poor-new"]


@pytest.mark.parametrize("name", ["attention", "adaptive"])
def test_idle_aging_half_life_follows_the_victims_idle_time(name):
    """``tau`` converges to ``idle_aging`` x the victims' idle time; every resident block is re-scored
    with the new ``tau`` from the time it was scored at, so the order by age is kept."""
    clock = FakeClock()
    pol = build(name, clock, idle_aging=0.5, cost_fn=lambda k, s: 2.0 if k == "a" else 1.0,
                tails_first=False, freq_cap=1.0)
    pol.on_insert("a", 1)
    clock.now += 7.0
    pol.on_insert("b", 1)
    keep = {"a", "b"}.__contains__
    taus = set()
    for i in range(4000):  # every other block lives 60 s unused, then it is the victim
        pol.on_insert(i, 1)
        clock.now += 60.0
        assert pol.victims(1, keep) == [i]
        pol.on_remove(i)
        taus.add(pol.tau)
        # a (twice b's value, scored 7 s earlier) leads b by 1 - 7 / tau whatever tau is now
        assert pol.priority("a") - pol.priority("b") == pytest.approx(1.0 - 7.0 / pol.tau)
    assert len(taus) > 3 and 24.0 <= pol.tau <= 40.0  # 0.5 x 60 s, within the 25% re-score step
    assert pol.victims(1) == ["b"]
    pol.update(beta=0.7)  # a weight changed: re-scored, each block still aged from when it was scored
    assert pol.priority("a") - pol.priority("b") == pytest.approx(1.0 - 7.0 / pol.tau)


@pytest.mark.parametrize("name", ["attention", "adaptive"])
def test_idle_aging_refreshes_a_stale_reuse_factor_and_keeps_the_idle_time(name):
    """A block whose learned chance of a return has moved by 2x or more since it was scored is
    re-scored as victims leave, from the time it was scored at; a smaller move leaves it be."""
    clock, chance = FakeClock(), {"a": 1.0, "b": 1.0}
    pol = build(name, clock, idle_aging=1.0, tails_first=False, freq_cap=1.0,
                reuse=lambda k: chance.get(k, 1e-6))
    pol.on_insert("a", 1)
    clock.now += 10.0
    pol.on_insert("b", 1)
    before = {k: pol.priority(k) for k in "ab"}
    chance.update(a=0.25, b=0.8)  # the model learned: a's class comes back a quarter as often
    pol.on_insert("filler", 1)
    assert pol.victims(1, {"a", "b"}.__contains__) == ["filler"]
    pol.on_remove("filler")  # a victim moves the refresh hand over the blocks
    assert pol.priority("a") == pytest.approx(before["a"] - 2.0)  # log2(0.25), still aged from t = 0
    assert pol.priority("b") == before["b"]
    assert pol.victims(1) == ["a"]


def test_attention_shared_history_survives_demotion():
    clock, hist = FakeClock(), History()
    host = make_policy("attention", clock=clock, history=hist)
    disk = make_policy("attention", clock=clock, history=hist)
    host.on_insert("hot", 1)
    for _ in range(6):
        host.on_access("hot")
    host.on_remove("hot")
    disk.on_insert("hot", 1)
    disk.on_insert("cold", 1)
    assert disk.victims(1) == ["cold"]
    assert hist.seen("hot") == 6


def test_adaptive_with_a_fixed_weight_of_one_scores_as_attention():
    clock = FakeClock()
    pols = [build("attention", clock), build("adaptive", clock, adapt_step=0.0)]
    for pol in pols:
        parent = None
        for i in range(12):
            pol.on_insert(i, 1 + i % 3, parent)
            for _ in range(i % 4):
                pol.on_access(i)
            parent = i if i % 5 else None
    assert [pols[0].priority(k) for k in range(12)] == [pols[1].priority(k) for k in range(12)]
    assert pols[0].victims(7) == pols[1].victims(7)


def _evict_and_return(pol, keys, uses: int) -> None:
    """Put ``keys`` in, used ``uses`` times each, evict them all, then insert them again."""
    for k in keys:
        pol.on_insert(k, 1)
        for _ in range(uses):
            pol.on_access(k)
    for k in pol.victims(len(pol)):
        pol.on_remove(k)
    for k in keys:
        pol.on_insert(k, 1)


@pytest.mark.parametrize(("uses", "direction"), [(1, -1), (3, 1)])
def test_adaptive_moves_the_frequency_weight_toward_the_class_that_returns(uses, direction):
    pol = build("adaptive", FakeClock(), adapt_step=0.1, window=64)
    _evict_and_return(pol, list(range(20)), uses)
    once, reused = pol.rates()
    assert (reused - once) * direction > 0
    assert (pol.weight - 1.0) * direction > 0
    assert pol.settings()["weight_min"] <= pol.weight <= pol.settings()["weight_max"]


def test_adaptive_reweighs_resident_blocks_at_the_clock_they_were_scored_at():
    clock = FakeClock()
    pol = build("adaptive", clock, adapt_step=0.0, freq_weight=1.0)
    for k in range(8):
        pol.on_insert(k, 1)
        for _ in range(k):
            pol.on_access(k)
    before = {k: pol.priority(k) for k in range(8)}
    pol.weight = 2.0
    pol._reweigh()
    for k in range(8):  # level 0: the priority is F' * C / S, now F'^2 * C / S
        lvl, freq, *_ = pol._parts[k]
        assert lvl == 0.0
        assert pol.priority(k) == pytest.approx(before[k] * freq)
    with pytest.raises(ValueError):
        pol.update(adapt_step=-1)


def test_history_is_bounded():
    hist = History(max_entries=3)
    for k in range(5):
        hist.use(k, 0.0, 0.0)
    assert len(hist) == 3 and 0 not in hist and 4 in hist
    assert hist.record(10, 0.0, parent=4).depth == 1


def test_protected_default_is_never():
    assert never("x") is False


@pytest.mark.parametrize("name", [n for n in ALL if issubclass(type(build(n)), HeapPolicy)])
def test_heap_policy_state_stays_bounded_under_churn(name):
    """Per-key state follows the resident blocks: 20,000 one-shot keys through a tier whose victims()
    is never called (a disk that never fills) leave nothing behind, and the lazy heap of a tier under
    eviction stays within its rebuild bound (stale entries at most ~3x the live ones)."""
    p = build(name)
    for i in range(20_000):
        p.on_insert(("once", i), 100, ("once", i - 1) if i % 8 else None)
        p.on_access(("once", i))
        p.on_remove(("once", i))
    assert len(p) == 0
    for attr in ("_size", "_prio", "_ver", "_pending", "_parent", "_kids", "_heap"):
        assert not getattr(p, attr), attr
    rng = random.Random(5)
    live: list[int] = []
    for i in range(20_000):
        p.on_insert(i, 100, live[-1] if live and rng.random() < 0.7 else None)
        live.append(i)
        for k in rng.sample(live, min(3, len(live))):
            p.on_access(k)
        if len(live) > 200:
            for k in p.victims(300) or []:
                p.on_remove(k)
                live.remove(k)
        # the rebuild bound is checked when victims() flushes, before that call's victims leave
        assert len(p._heap) <= 4 * (len(p) + 3) + 1024 and len(p._pending) <= len(p)

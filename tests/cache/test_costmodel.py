"""Cost model: measured tier speeds versus recompute."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.cache.costmodel import DEFAULT_PRIORS, CostModel, Run

MB = 1 << 20
# A 7-8B model: ~128 KiB of KV per token; 16-token blocks of 2 MiB.
KV_PER_TOKEN = 128 << 10


def feed(model: CostModel, tier: str, bandwidth: float, latency: float, sizes) -> None:
    for n in sizes:
        model.observe(tier, n, latency + n / bandwidth)


def test_slow_tier_is_recomputed_fast_tier_is_fetched():
    model = CostModel(recompute_tokens_per_s=10_000)
    tokens = 256
    nbytes = tokens * KV_PER_TOKEN  # 32 MiB; recompute ~27 ms
    feed(model, "disk", 50e6, 5e-3, [2 * MB] * 5)  # a sick disk: 50 MB/s -> 0.67 s to fetch
    feed(model, "host", 20e9, 50e-6, [2 * MB] * 5)
    slow, fast = model.plan([Run("disk", nbytes, tokens)]), model.plan([("host", nbytes, tokens)])
    assert not slow[0].fetch and slow[0].fetch_s > slow[0].recompute_s
    assert fast[0].fetch and fast[0].fetch_s < fast[0].recompute_s
    assert fast[0].recompute_s == pytest.approx(model.recompute_seconds(tokens))

    # The same disk turns fast again: the estimate follows and fetching wins.
    feed(model, "disk", 5e9, 200e-6, [2 * MB] * 60)
    assert model.plan([("disk", nbytes, tokens)])[0].fetch


def test_ema_converges_to_bandwidth_and_latency():
    model = CostModel(alpha=0.2)
    sizes = [(1 + (i * 7) % 16) * MB for i in range(60)]
    feed(model, "remote", 1.25e9, 1.5e-3, sizes)
    assert model.bandwidth("remote") == pytest.approx(1.25e9, rel=1e-3)
    assert model.latency("remote") == pytest.approx(1.5e-3, rel=1e-3)
    # A change of speed: old observations fade out.
    feed(model, "remote", 0.3e9, 4e-3, sizes[:50])
    assert model.bandwidth("remote") == pytest.approx(0.3e9, rel=0.02)
    assert model.latency("remote") == pytest.approx(4e-3, rel=0.05)
    assert model.snapshot()["tiers"]["remote"]["source"] == "measured"


def test_fixed_size_observations_predict_that_size_exactly():
    model = CostModel()
    feed(model, "disk", 3e9, 1e-3, [2 * MB] * 10)
    assert model.fetch_seconds("disk", 2 * MB) == pytest.approx(1e-3 + 2 * MB / 3e9)
    assert model.latency("disk") == DEFAULT_PRIORS["disk"].latency  # not identifiable: prior kept


def test_priors_until_enough_observations():
    model = CostModel({"disk": (2e9, 1e-3)}, min_observations=3)
    assert model.fetch_seconds("disk", 2_000_000) == pytest.approx(2e-3)
    model.observe("disk", 2_000_000, 1.0)
    model.observe("disk", 2_000_000, 1.0)
    assert model.fetch_seconds("disk", 2_000_000) == pytest.approx(2e-3)
    model.observe("disk", 2_000_000, 1.0)
    assert model.fetch_seconds("disk", 2_000_000) == pytest.approx(1.0)
    # A tier without a prior is learned from its first observation; before that it is unknown.
    with pytest.raises(ValueError):
        model.fetch_seconds("nvme-of", 1)
    model.observe("nvme-of", 1000, 0.5)
    assert model.fetch_seconds("nvme-of", 1000) == pytest.approx(0.5)


def test_recompute_speed_observed_reported_and_depth():
    model = CostModel(recompute_tokens_per_s=10_000, attention_tokens=32_768, min_observations=1)
    assert model.recompute_seconds(1000) == pytest.approx((1000 + 1000**2 / 2 / 32768) / 10_000)
    assert model.recompute_seconds(1000, depth=30_000) > 1.9 * model.recompute_seconds(1000)
    # Costs of consecutive runs add up to the cost of the whole.
    assert model.recompute_seconds(300, 100) + model.recompute_seconds(700, 400) == pytest.approx(
        model.recompute_seconds(1000, 100))
    for _ in range(30):
        model.observe_recompute(2048, model._work(2048, 0) / 4000)
    assert model.recompute_tokens_per_s() == pytest.approx(4000)
    model.set_recompute_speed(25_000)
    assert model.recompute_tokens_per_s() == pytest.approx(25_000)


def test_prefix_planning_stops_at_the_first_slow_run():
    model = CostModel({"host": (20e9, 50e-6), "disk": (20e6, 5e-3)}, recompute_tokens_per_s=10_000)
    runs = [("host", 64 * MB, 512), ("disk", 64 * MB, 512), ("host", 64 * MB, 512)]
    assert [p.fetch for p in model.plan(runs)] == [True, False, False]
    assert [p.fetch for p in model.plan(runs, prefix=False)] == [True, False, True]
    plans = model.plan(runs, depth=100)
    assert [p.depth for p in plans] == [100, 612, 1124]
    assert model.plan([]) == []


@settings(max_examples=200, deadline=None)
@given(
    runs=st.lists(st.tuples(st.sampled_from(["gpu", "host", "disk", "remote"]),
                            st.integers(0, 1 << 30), st.integers(0, 4096)), max_size=6),
    tps=st.floats(100, 1e6),
    disk_bw=st.floats(1e6, 1e10),
    depth=st.integers(0, 100_000),
)
def test_a_planned_hit_is_never_slower_than_recompute(runs, tps, disk_bw, depth):
    model = CostModel(recompute_tokens_per_s=tps)
    feed(model, "disk", disk_bw, 1e-3, [MB, 4 * MB, 16 * MB])
    plans = model.plan(runs, depth=depth)
    chosen = sum(p.fetch_s if p.fetch else p.recompute_s for p in plans)
    all_recompute = sum(p.recompute_s for p in plans)
    all_fetch = sum(p.fetch_s for p in plans)
    assert chosen <= all_recompute * (1 + 1e-9) + 1e-12
    assert chosen <= all_fetch * (1 + 1e-9) + 1e-12
    # Decisions form a prefix: fetch, fetch, ..., recompute, recompute.
    flags = [p.fetch for p in plans]
    assert flags == sorted(flags, reverse=True)


def test_bad_values():
    model = CostModel()
    for args in (("disk", -1, 1.0), ("disk", 1.5, 1.0), ("disk", 10, -1.0), ("disk", 10, math.nan),
                 ("", 10, 1.0), (None, 10, 1.0), ("disk", True, 1.0)):
        with pytest.raises(ValueError):
            model.observe(*args)
    for kwargs in ({"alpha": 0}, {"alpha": 1.5}, {"recompute_tokens_per_s": 0}, {"safety": -1},
                   {"priors": {"disk": (0, 1e-3)}}, {"priors": {"disk": (1e9, -1)}}, {"min_observations": -1},
                   {"attention_tokens": 0}):
        with pytest.raises(ValueError):
            CostModel(**kwargs)
    with pytest.raises(ValueError):
        model.observe_recompute(-5, 1.0)
    with pytest.raises(ValueError):
        model.set_recompute_speed(0)
    with pytest.raises(ValueError):
        model.recompute_seconds(10, depth=-1)
    with pytest.raises(ValueError):
        model.plan([("disk", 10)])
    with pytest.raises(ValueError):
        model.plan([("tape", 10, 10)])
    with pytest.raises(ValueError):
        model.fetch_seconds("disk", -1)

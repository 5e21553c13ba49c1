"""The reuse model (tierkv/cache/reuse/model.py): its classes, tails and bounds, and its counts across
restarts."""

from __future__ import annotations

import pytest

from tierkv.cache.reuse import ReuseModel


def test_reuse_model_counts_load_only_when_they_fit():
    m = ReuseModel(ghost_entries=16)
    for i in range(40):
        m.requested([("k", i)], float(i))
        m.left(("k", i), float(i))
    m.requested([("k", 30), ("k", 31)], 50.0)  # two returns
    saved = m.counts()
    fresh = ReuseModel()
    assert fresh.load_counts(saved) and fresh.restored
    assert fresh.snapshot()["classes"] == m.snapshot()["classes"]
    big = {**saved, "gone": {c: 1e9 for c in saved["gone"]}}
    capped = ReuseModel()
    assert capped.load_counts(big, keep=100.0)
    assert all(n <= 100.0 for n in capped.counts()["gone"].values())  # old counts weigh at most 100
    for bad in (None, [], {**saved, "version": 99}, {**saved, "output_edges": "64"},
                {**saved, "back": {"x": 1}}, {**saved, "back": {1: -1}}, {**saved, "gone": {1: float("nan")}},
                {**saved, "back": {99999: 1}}, {**saved, "gone": "many"}):
        other = ReuseModel()
        assert not other.load_counts(bad) and not other.restored and other.counts()["back"] == {}


def test_reuse_model_output_classes():
    m = ReuseModel()
    for name, out in (("a", 10), ("b", 500), ("c", None)):
        m.requested([(name, 0), (name, 1)], 0.0)
        m.request_finished([(name, 0), (name, 1)], 0.0, out)
    classes = {name: m.block_class((name, 0), 1.0) for name in "abc"}
    assert len(set(classes.values())) == 3  # short, long, not said
    off = ReuseModel(output_edges="")
    for name, out in (("a", 10), ("b", 500)):
        off.requested([(name, 0), (name, 1)], 0.0)
        off.request_finished([(name, 0), (name, 1)], 0.0, out)
    assert off.block_class(("a", 0), 1.0) == off.block_class(("b", 0), 1.0)
    assert off.snapshot()["finished_with_output_tokens"] == 2
    for bad in ("abc", "128,32", "0", "-4", "32,32", "1,2,3,4,5,6,7"):
        with pytest.raises(ValueError, match="output_edges"):
            ReuseModel(output_edges=bad)
    m.update(output_edges="64")
    with pytest.raises(ValueError):
        m.update(output_edges="x")
    assert m.settings()["output_edges"] == "64"  # a bad update changes nothing


def test_reuse_model_tails_extension_and_bounds():
    m = ReuseModel(max_records=32, ghost_entries=16)
    m.requested(["a", "b"], 0.0)
    m.request_finished(["a", "b"], 1.0)
    tail_cls = m.block_class("b", 2.0)
    m.requested(["a", "b", "c"], 3.0)  # the next turn extends the chain: "b" is not its tail
    assert m.block_class("b", 4.0) != tail_cls and m.uses("b") == 2 and m.depth("c") == 2
    assert m.block_class("c", 3.0 + 601.0) != m.block_class("c", 4.0)  # a chain idle past the TTL
    for i in range(100):
        m.requested([("k", i)], 10.0 + i)
        m.left(("k", i), 10.0 + i)
    assert len(m._rec) <= 32 and len(m._ghost) <= 16
    assert m.class_p(m.block_class(("k", 99), 200.0)) < 0.2  # none of them came back
    m.left("a", 300.0, horizon=20)
    m.stored(["a"], 301.0)  # dropped, then computed and stored again: a return
    assert m.returns == 1
    with pytest.raises(ValueError):
        ReuseModel(ghost_entries=1)


def test_stored_blocks_after_a_requested_prefix_extend_its_chain():
    """An engine asks for its cached prefix, then stores the rest continuing it: the model learns the
    request's chain as if the request had named it whole (as ``tierkv replay`` tells it)."""
    whole, parts = ReuseModel(), ReuseModel()
    whole.requested(["s", "a", "b", "c"], 5.0)
    parts.requested(["s", "a"], 5.0)
    parts.stored(["b", "c"], 5.0, parent="a")
    for key in "sabc":
        assert parts.block_class(key, 6.0) == whole.block_class(key, 6.0)
        assert (parts.depth(key), parts.uses(key)) == (whole.depth(key), whole.uses(key))
    assert parts.is_tail("c") and not parts.is_tail("a")
    apart = ReuseModel()  # a parent that does not end the chain a request named: a chain of its own
    apart.requested(["s", "a", "x"], 5.0)
    apart.stored(["b", "c"], 5.0, parent="a")
    assert apart.depth("b") == 0 and apart.is_tail("x") and apart.is_tail("c")

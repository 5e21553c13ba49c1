"""The contract every registered eviction policy keeps (``tierkv.cache.policy.base``): victims are
all or nothing and never protected, ``victims`` changes nothing, removal and re-insertion keep the
policy's membership and sizes equal to the tier's, and capacity is respected."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import FakeClock
from tests.helpers import build_policy as build
from tierkv.cache.policy import Policy, policy_names

ALL = policy_names(oracles=True)


def _populate(pol: Policy, rng: random.Random, clock: FakeClock, future: dict, n: int = 120) -> dict:
    """Chains of blocks of mixed sizes, accessed in random order. Returns key -> (size, parent)."""
    blocks: dict = {}
    key = 0
    while key < n:
        parent = None
        for _ in range(rng.randint(1, 6)):
            size = rng.choice([1, 2, 4, 8])
            future[key] = rng.random() * 100
            pol.on_insert(key, size, parent)
            pol.on_access(key)
            blocks[key] = (size, parent)
            parent = key
            key += 1
            clock.now += rng.random()
    for _ in range(200):
        k = rng.randrange(n)
        clock.now += rng.random()
        future[k] = rng.random() * 100
        pol.on_access(k)
    return blocks


def _state(pol: Policy, keys) -> tuple:
    return len(pol), tuple(k in pol for k in keys)


@pytest.mark.parametrize("name", ALL)
def test_contract_victims_atomic_protected_and_pure(name):
    rng, clock, future = random.Random(7), FakeClock(), {}
    pol = build(name, clock, future)
    blocks = _populate(pol, rng, clock, future)
    keys = list(blocks)
    children = {}
    for k, (_, parent) in blocks.items():
        if parent is not None:
            children.setdefault(parent, []).append(k)
    total = sum(s for s, _ in blocks.values())
    for trial in range(60):
        protected_set = set(rng.sample(keys, rng.randint(0, len(keys) // 2)))
        nbytes = rng.randint(-2, total + 5)
        before = _state(pol, keys)
        out = pol.victims(nbytes, protected_set.__contains__)
        assert _state(pol, keys) == before, "victims() must not change membership"
        assert pol.victims(nbytes, protected_set.__contains__) == out, "victims() must be repeatable"
        if nbytes <= 0:
            assert out == []
            continue

        def has_protected_descendant(k, protected_set=protected_set):
            stack = list(children.get(k, []))
            while stack:
                c = stack.pop()
                if c in protected_set:
                    return True
                stack.extend(children.get(c, []))
            return False
        # every policy must manage when enough blocks are free and no protected block hangs below them
        free_leafwise = sum(blocks[k][0] for k in keys if k not in protected_set and not has_protected_descendant(k))
        if out is None:
            assert nbytes > free_leafwise, f"trial {trial}: gave up although {free_leafwise} bytes were free"
            continue
        assert len(out) == len(set(out))
        assert all(k in pol for k in out)
        assert not protected_set.intersection(out), "a protected block was chosen"
        assert sum(blocks[k][0] for k in out) >= nbytes


@pytest.mark.parametrize("name", ALL)
def test_contract_capacity_respected(name):
    """A tier that evicts what the policy names never exceeds its capacity."""
    rng, clock, future = random.Random(3), FakeClock(), {}
    pol = build(name, clock, future)
    cap, used, sizes, live = 64, 0, {}, set()
    next_key = 0
    for step in range(1500):
        clock.now += rng.random()
        if live and rng.random() < 0.4:
            k = rng.choice(sorted(live))
            future[k] = step + rng.random() * 50
            pol.on_access(k)
            continue
        size = rng.choice([1, 2, 3, 8])
        key, next_key = next_key, next_key + 1
        future[key] = step + rng.random() * 50
        pinned = set(rng.sample(sorted(live), min(len(live), 3)))
        need = used + size - cap
        if need > 0:
            out = pol.victims(need, pinned.__contains__)
            if out is None:
                continue  # the tier refuses the block; nothing changed
            for v in out:
                assert v not in pinned
                pol.on_remove(v)
                live.discard(v)
                used -= sizes.pop(v)
        pol.on_insert(key, size, None)
        pol.on_access(key)
        live.add(key)
        sizes[key] = size
        used += size
        assert used <= cap
        assert len(pol) == len(live)
    for k in list(live):
        pol.on_remove(k)
    assert len(pol) == 0


@pytest.mark.parametrize("name", ALL)
def test_contract_membership_and_settings(name):
    pol = build(name)
    assert len(pol) == 0 and "a" not in pol
    pol.on_insert("a", 10)
    pol.on_access("a")
    pol.on_access("zzz")           # unknown keys are ignored
    pol.on_remove("zzz")
    pol.on_touch("a", 2.0)
    pol.on_sharers("a", 3)
    assert "a" in pol and len(pol) == 1
    assert pol.victims(10) == ["a"]
    assert pol.victims(11) is None
    assert pol.victims(1, lambda k: True) is None
    pol.on_remove("a")
    assert "a" not in pol and len(pol) == 0
    before = pol.settings()
    with pytest.raises(ValueError):
        pol.update(no_such_setting=1)
    assert pol.settings() == before
    for key, spec in type(pol).SETTINGS.items():
        bad = "not-a-number" if not isinstance(spec.default, str) else 12345
        with pytest.raises(ValueError, match=key):
            pol.update(**{key: bad})
        assert pol.settings() == before


@pytest.mark.parametrize("name", ALL)
def test_contract_victims_stop_early(name):
    """Freeing one block of many looks at a handful of blocks, not all of them."""
    pol = build(name)
    for k in range(5000):
        pol.on_insert(k, 1, None)
        pol.on_access(k)
    calls = []

    def protected(k):
        calls.append(k)
        return False
    assert len(pol.victims(3, protected)) == 3
    assert len(calls) < 50


# -- any sequence of events against a model of the tier ------------------------------------------

_KEYS = st.integers(0, 40)
_OPS = st.one_of(
    st.tuples(st.just("insert"), _KEYS, st.integers(1, 8), st.integers(0, 4)),
    st.tuples(st.just("access"), _KEYS),
    st.tuples(st.just("remove"), _KEYS),
    st.tuples(st.just("touch"), _KEYS, st.floats(0.0, 8.0)),
    st.tuples(st.just("sharers"), _KEYS, st.integers(0, 4)),
    st.tuples(st.just("victims"), st.integers(-1, 120), st.integers(0, 2**31)),
    st.tuples(st.just("evict"), st.integers(1, 40), st.integers(0, 2**31)),
    st.tuples(st.just("tick"), st.floats(0.0, 500.0)),
)


def _leafwise_free(sizes: dict, parents: dict, protected: set) -> int:
    """Bytes a tails-first policy can free: unprotected blocks with no protected resident descendant."""
    blocked: set = set()
    for k in protected:
        p = parents.get(k)
        while p is not None and p in sizes and p not in blocked:
            blocked.add(p)
            p = parents.get(p)
    return sum(s for k, s in sizes.items() if k not in protected and k not in blocked)


def _check_victims(pol: Policy, sizes: dict, parents: dict, nbytes: int, seed: int) -> None:
    rng = random.Random(seed)
    protected = {k for k in sizes if rng.random() < 0.3}
    before = (len(pol), {k: k in pol for k in range(41)})
    out = pol.victims(nbytes, protected.__contains__)
    assert (len(pol), {k: k in pol for k in range(41)}) == before, "victims() changed membership"
    assert pol.victims(nbytes, protected.__contains__) == out, "victims() is not repeatable"
    if nbytes <= 0:
        assert out == []
        return
    if out is None:
        assert nbytes > _leafwise_free(sizes, parents, protected), "gave up although enough was free"
        return
    assert len(out) == len(set(out)), "a victim was named twice"
    assert all(k in sizes for k in out), "a victim is not resident (removed blocks must be forgotten)"
    assert not protected.intersection(out), "a protected block was chosen"
    assert sum(sizes[k] for k in out) >= nbytes, "victims free less than asked (sizes of re-added blocks)"


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_OPS, max_size=80))
def test_contract_events_match_the_tier(name, ops):
    """Inserting (also over a resident key), using, removing and re-adding blocks in any order keeps
    the policy's members and sizes equal to the tier's; victims hold the contract throughout."""
    clock, future = FakeClock(), {}
    pol = build(name, clock, future)
    sizes: dict[int, int] = {}
    parents: dict[int, int] = {}
    for step, op in enumerate(ops):
        kind = op[0]
        if kind == "insert":
            _, key, size, back = op
            parent = key - back if 0 < back <= key else None  # parents are older keys: no cycles
            future[key] = step + (key * 7919 % 97)
            pol.on_insert(key, size, parent)
            pol.on_access(key)
            sizes[key] = size
            if parent is None:
                parents.pop(key, None)
            else:
                parents[key] = parent
        elif kind == "access":
            future[op[1]] = step + (op[1] * 104729 % 89)
            pol.on_access(op[1])
        elif kind == "remove":
            pol.on_remove(op[1])
            sizes.pop(op[1], None)
            parents.pop(op[1], None)
        elif kind == "touch":
            pol.on_touch(op[1], op[2])
        elif kind == "sharers":
            pol.on_sharers(op[1], op[2])
        elif kind == "tick":
            clock.now += op[1]
        elif kind == "victims":
            _check_victims(pol, sizes, parents, op[1], op[2])
        else:  # the tier frees room: it removes exactly the victims named
            rng = random.Random(op[2])
            pinned = {k for k in sizes if rng.random() < 0.2}
            for v in pol.victims(op[1], pinned.__contains__) or []:
                pol.on_remove(v)
                sizes.pop(v)
                parents.pop(v, None)
        assert len(pol) == len(sizes)
        assert all(k in pol for k in sizes)
    total = sum(sizes.values())
    everything = pol.victims(total) if sizes else []
    assert everything is not None and set(everything) == set(sizes), "nothing protected: every block can go"
    for k in list(sizes):
        pol.on_remove(k)
    assert len(pol) == 0 and pol.victims(1) is None

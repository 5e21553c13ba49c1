"""The sampled shadow: which eviction order a tier follows, and the same shadow in replay and daemon."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from tests.helpers import line
from tierkv.cache.policy import make_policy
from tierkv.cache.policy.shadow import key_hash
from tierkv.cache.reuse import History, ReuseModel
from tierkv.daemon.startup import make_disk_policy, make_host_policy
from tierkv.ops.replay_cli import daemon_config, tiers_for
from tierkv.sim.replay import ReplayConfig, TierSpec, Workload, parse_trace
from tierkv.sim.simulator import Simulator


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def hit_rate(policy, refs, blocks: int, clock: Clock, below: bool = False) -> float:
    """One tier of ``blocks`` one-byte blocks under ``policy``; the fraction of ``refs`` that hit.
    ``below``: the tier is under another that holds none of these keys, so every reference is one of
    its own (``referenced``, its shadow's feed there)."""
    hits = 0
    for key in refs:
        clock.now += 1.0
        if below:
            policy.referenced(key)
        if key in policy:
            hits += 1
        else:
            if len(policy) >= blocks:
                for v in policy.victims(1):
                    policy.on_remove(v)
            policy.on_insert(key, 1)
        policy.on_access(key)
    return hits / len(refs)


def recency_refs(n: int, gap: int) -> list[int]:
    """Each key used twice, ``gap`` references apart, no scan: recency is all there is."""
    refs: list[int] = []
    for t in range(n):
        refs.append(t)
        if t >= gap:
            refs.append(t - gap)
    return refs


def frequency_refs(n: int, hot: int) -> list[int]:
    """A hot set used over and over between one-time keys (a scan longer than the tier)."""
    refs, scan = [], 10_000
    for t in range(n):
        refs.append(t % hot)
        refs.append(scan + t)
    return refs


def attention(clock: Clock, **settings):
    return make_policy("attention", clock=clock, **settings)


def test_shadow_follows_lru_where_recency_wins():
    # a learned chance of a return that is wrong for this traffic: odd keys are rated as never coming
    # back, yet every key comes back once
    def wrong(key):
        return 0.05 if key % 2 else 1.0

    refs, blocks = recency_refs(3000, 40), 90
    lru = hit_rate(make_policy("lru", clock=Clock()), refs, blocks, Clock())
    alone = hit_rate(attention(Clock(), reuse=wrong), refs, blocks, Clock())
    clock = Clock()
    policy = attention(clock, reuse=wrong, shadow_rate=1.0)
    shadowed = hit_rate(policy, refs, blocks, clock)
    assert alone < lru - 0.05  # the learned order alone loses to recency here
    assert policy.follows_lru and policy.shadow.snapshot()["leader"] == "lru"
    assert shadowed >= lru - 0.01 and shadowed > alone


def test_a_tier_that_follows_lru_still_takes_chains_from_the_tail():
    """In LRU order a chain's head is the oldest block (it is used first): following LRU, the tier
    still takes each chain's blocks from the tail, oldest chain first, so every chain keeps a prefix."""
    def wrong(key):
        return 0.05 if key % 2 else 1.0

    clock = Clock()
    policy = attention(clock, reuse=wrong, shadow_rate=1.0)
    hit_rate(policy, recency_refs(3000, 40), 90, clock)
    assert policy.follows_lru
    for key in list(policy._recent):
        policy.on_remove(key)
    for chain in (100_000, 200_000):  # two chains of 4, the first used longer ago
        for i in range(4):
            clock.now += 1.0
            policy.on_insert(chain + i, 1, parent=chain + i - 1 if i else None)
            policy.on_access(chain + i)
    assert policy.victims(1) == [100_003]
    assert policy.victims(6) == [100_003, 100_002, 100_001, 100_000, 200_003, 200_002]
    assert policy.victims(2, lambda k: k == 100_003) == [200_003, 200_002]  # a held tail keeps its chain
    assert policy.victims(9) is None


def test_shadow_keeps_the_learned_order_where_frequency_wins():
    refs, blocks = frequency_refs(3000, 30), 40
    lru = hit_rate(make_policy("lru", clock=Clock()), refs, blocks, Clock())
    alone = hit_rate(attention(Clock()), refs, blocks, Clock())
    clock = Clock()
    policy = attention(clock, shadow_rate=1.0)
    shadowed = hit_rate(policy, refs, blocks, clock)
    assert alone > lru + 0.1  # the scan flushes LRU; the frequency score keeps the hot set
    assert not policy.follows_lru and policy.shadow.switches == 0
    # the copy the shadow runs brings the shared use records forward in time in other steps, which
    # moves float ties; the order followed is the same
    assert shadowed == pytest.approx(alone, abs=0.005)


def test_a_lower_tier_shadow_follows_lru_where_recency_wins_and_the_score_where_frequency_does():
    """The disk's shadow sees the disk's references (``referenced``), not only the uses of the blocks
    it holds: it finds LRU ahead on recency traffic and the score ahead on a hot set under a scan."""
    def wrong(key):
        return 0.05 if key % 2 else 1.0

    def below(refs, blocks, **settings):
        clock = Clock()
        policy = attention(clock, shadow_rate=1.0, **settings)
        policy.shadow_on_requests = True
        return policy, hit_rate(policy, refs, blocks, clock, below=True)

    refs = recency_refs(3000, 40)
    lru = hit_rate(make_policy("lru", clock=Clock()), refs, 90, Clock(), below=True)
    policy, got = below(refs, 90, reuse=wrong)
    assert policy.follows_lru and got >= lru - 0.01
    refs = frequency_refs(3000, 30)
    lru = hit_rate(make_policy("lru", clock=Clock()), refs, 40, Clock(), below=True)
    policy, got = below(refs, 40)
    assert not policy.follows_lru and got > lru + 0.1
    policy = attention(Clock(), shadow_rate=1.0)  # a first tier: ``referenced`` is not its feed
    policy.referenced(1)
    assert policy.shadow.references == 0


def test_shadow_off_is_the_plain_score():
    refs, blocks = recency_refs(500, 20), 30
    a, b = Clock(), Clock()
    assert hit_rate(attention(a), refs, blocks, a) == hit_rate(attention(b, shadow_rate=0.0), refs, blocks, b)


def test_key_sample_is_a_fixed_fraction():
    ints = sum(key_hash(i) < 0.1 for i in range(20_000)) / 20_000
    raw = sum(key_hash(i.to_bytes(16, "little")) < 0.1 for i in range(20_000)) / 20_000
    assert 0.09 < ints < 0.11 and 0.09 < raw < 0.11
    assert key_hash(b"k") == key_hash(b"k") and 0 <= key_hash(7) < 1


def test_branches_part_where_chains_part():
    """A block's branch starts below the last block its chain shares with another chain: requests
    that share a prompt have branches of their own, and a chain extended alone stays one branch."""
    h = History()

    def use(chain):
        parent = None
        for key in chain:
            h.record(key, 0.0, parent)
            parent = key
        return [h.branch(key) for key in chain]

    assert use(["p0", "p1", "a0", "a1"]) == ["p0"] * 4  # one chain: one branch so far
    assert use(["p0", "p1", "b0", "b1"]) == ["p0", "p0", "b0", "b0"]  # p1 has two children now
    assert use(["p0", "p1", "a0", "a1", "a2"]) == ["p0", "p0", "a0", "a0", "a0"]
    assert h.branch("unknown") == "unknown"


def test_the_shadow_samples_whole_branches():
    """Every use of a block in a sampled branch reaches the shadow, and none of the others."""
    clock = Clock()
    policy = attention(clock, shadow_rate=0.5)
    sent = 0
    for conv in range(40):
        chain = [("prompt", 0), ("prompt", 1)] + [("conv", conv, i) for i in range(4)]
        for turn in range(2):
            parent = None
            for key in chain[:4 + turn * 2]:
                clock.now += 1.0
                if key not in policy:
                    policy.on_insert(key, 1, parent)
                policy.on_access(key)
                sent += policy.shadow.sampled(policy.history.branch(key))
                parent = key
    branches = {policy.history.branch(("conv", c, 0)) for c in range(40)}
    assert branches == {("conv", c, 0) for c in range(40)}
    assert policy.shadow.references == sent
    sampled = [c for c in range(40) if policy.shadow.sampled(("conv", c, 0))]
    assert 0 < len(sampled) < 40


def test_replay_and_daemon_run_the_same_host_shadow():
    """``tierkv replay --policy default`` and the daemon build the host policy with the same shadow
    from the same config, and on the same events the two choose the same victims."""
    daemon = daemon_config(None)
    assert daemon.host.shadow_rate > 0
    w = Workload(parse_trace([line(i * 1000, 1024, [i % 5, 100 + i]) for i in range(40)]))
    tiers = [TierSpec("host", "10%"), TierSpec("disk", "30%", inclusive=True)]
    sim = Simulator(w, "default", tiers_for("default", ReplayConfig(tiers=tiers), daemon, "all"))
    host = make_host_policy(daemon, History(), ReuseModel(output_edges=""))
    keys = ("shadow_rate", "shadow_window", "shadow_z")
    assert {k: sim.policies[0].settings()[k] for k in keys} == {k: host.settings()[k] for k in keys}
    assert sim.policies[0].shadow is not None and host.shadow is not None
    disk = make_disk_policy(daemon, History(), ReuseModel(output_edges=""))
    assert {k: sim.policies[1].settings()[k] for k in keys} == {k: disk.settings()[k] for k in keys}
    assert daemon.disk.order_shadow_rate > 0 and disk.shadow is not None and sim.policies[1].shadow is not None
    assert disk.shadow_on_requests and sim.policies[1].shadow_on_requests  # fed by the host's misses
    off = dataclasses.replace(daemon, host=dataclasses.replace(daemon.host, shadow_rate=0.0))
    assert make_host_policy(off, History(), ReuseModel(output_edges="")).shadow is None

    # the same events through the daemon's and the simulator's construction: the same victims
    clocks = [Clock(), Clock()]
    built = [make_host_policy(daemon, History(), ReuseModel(output_edges="")),
             make_host_policy(daemon, History(), ReuseModel(output_edges=""))]
    for p, c in zip(built, clocks):
        p.clock = c
        p.shadow.orders[0].clock = c
        p.shadow.orders[1].clock = c
    chosen: list[list] = [[], []]
    for i, (p, c) in enumerate(zip(built, clocks)):
        for key in recency_refs(400, 20):
            c.now += 1.0
            if key not in p:
                if len(p) >= 30:
                    for v in p.victims(1):
                        chosen[i].append(v)
                        p.on_remove(v)
                p.on_insert(key, 1)
            p.on_access(key)
    assert chosen[0] == chosen[1] and chosen[0]


def test_advise_measures_the_host_order_against_the_default(tmp_path):
    from click.testing import CliRunner

    from tierkv.ops.replay_cli import replay as replay_cmd

    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(line(i * 1000, 1024, [i % 5, 100 + i]) for i in range(40)) + "\n")
    res = CliRunner().invoke(replay_cmd, [str(path), "--advise", "--json", "--kv-bytes-per-token", "1"])
    assert res.exit_code == 0, res.output
    rec = json.loads(res.output)["recommended"]
    runs = rec["shadow_runs"]
    assert set(runs) >= {"0.0", "1.0", str(daemon_config(None).host.shadow_rate)}
    best = max(r["token_hit_rate"] for r in runs.values())
    assert runs[str(rec["shadow_rate"])]["token_hit_rate"] == best
    assert rec["gain_points"] == pytest.approx((best - rec["default"]["token_hit_rate"]) * 100)
    assert rec["gain_points"] >= 0
    res = CliRunner().invoke(replay_cmd, [str(path), "--advise", "--kv-bytes-per-token", "1"])
    assert "host.shadow_rate" in res.output and "against the default" in res.output


def replay_two_tiers(lines: list[str], host: str, disk: str) -> dict:
    """LRU writing every victim and the default (``configs/default.toml``) over host + disk."""
    daemon = daemon_config(None)
    w = Workload(parse_trace(lines))
    tiers = [TierSpec("host", host), TierSpec("disk", disk, inclusive=True)]
    out = {}
    for name in ("lru", "default"):
        sim = Simulator(w, name, tiers_for(name, ReplayConfig(tiers=tiers), daemon, "all"))
        out[name] = (sim.run().token_hit_rate * 100, sim.rules[1])
    return out


def returning_lines(n: int, pages: int, p: float, gap: int) -> list[str]:
    """Prompts of ``pages`` pages used once, a fraction ``p`` of them again ``gap`` requests later:
    once learned, a return chance too low to pay for a write (there is no writer bandwidth to spare)."""
    rng = random.Random(1)
    at: dict[int, list[list[int]]] = {}
    for i in range(n):
        ids = [i * pages + j for j in range(pages)]
        at.setdefault(i, []).append(ids)
        if rng.random() < p:
            at.setdefault(i + gap, []).append(ids)
    chains = [ids for i in sorted(at) for ids in at[i]]
    return [line((k + 1) * 1000, 512 * len(ids), ids) for k, ids in enumerate(chains)]


def test_disk_shadow_writes_every_victim_where_write_all_wins():
    """Victims the rule learns to skip come back: the shadow finds write-all ahead, every victim is
    written, and the two tiers hit within 0.3 points of LRU writing every victim."""
    runs = replay_two_tiers(returning_lines(40000, 4, 0.1, 30), "0.05%", "50%")
    (lru, _), (default, rule) = runs["lru"], runs["default"]
    shadow = rule.snapshot()["shadow"]
    assert rule.shadow is not None and rule.writes_all and shadow["leader"] == "all"
    assert shadow["wins"][1][0] > 0 and shadow["wins"][0][1] == 0
    assert default >= lru - 0.3
    assert rule.settings()["shadow_rate"] == daemon_config(None).disk.shadow_rate > 0  # the daemon's setting


def test_on_the_corpus_trace_of_late_returns_the_shadow_turns_to_write_all():
    """The corpus trace where selective admission loses (``returns``: a tenth of the prompts asked again
    600 requests later, after host memory let them go), replayed as tools/corpus_sweep.py replays two
    tiers (host 2% + disk 30%, a 2 GB/s writer that the trace keeps busy): the rule alone learns the
    return chance is too low to pay for a write and hits far less than LRU writing every victim; with
    its shadow the default finds write-all ahead, writes every victim from then on and gives up only
    the returns of what the rule skipped before the first of them came back."""
    from corpus_sweep import stack

    from tierkv.sim.corpus import HELD_OUT, requests

    assert "returns" in HELD_OUT
    w, daemon, cfg = Workload(requests("returns")), daemon_config(None), stack("30%")
    hit, rules = {}, {}
    for name, policy, settings in (("lru", "lru", {}), ("default", "default", {}),
                                   ("rule alone", "default", {"shadow_rate": 0.0})):
        run = dataclasses.replace(cfg, admission_settings=settings)
        sim = Simulator(w, policy, tiers_for(policy, run, daemon, "all"))
        hit[name], rules[name] = sim.run().token_hit_rate * 100, sim.rules[1]
    assert rules["default"].writes_all and rules["default"].snapshot()["shadow"]["leader"] == "all"
    assert hit["rule alone"] < hit["lru"] - 2.0  # the rule's skips come back: write-all wins by points
    assert hit["rule alone"] + 2.0 < hit["default"] < hit["lru"]


def scan_lines(n: int, hot: int) -> list[str]:
    """Every other prompt one of ``hot`` recurring ones, the rest used once: writing the one-time
    prompts pushes the recurring ones off a small disk."""
    rng = random.Random(1)
    out = []
    for i in range(n):
        base = 10**6 + rng.randrange(hot) * 3 if i % 2 else i * 3
        out.append(line((i + 1) * 1000, 3 * 512, [base, base + 1, base + 2]))
    return out


def test_disk_shadow_keeps_the_rule_where_it_wins():
    """One-time prompts the rule skips and recurring ones it keeps: the shadow keeps the rule."""
    runs = replay_two_tiers(scan_lines(6000, 150), "1%", "5%")
    (lru, _), (default, rule) = runs["lru"], runs["default"]
    assert rule.snapshot()["shadow"]["leader"] == "predicted" and not rule.writes_all
    assert default > lru


def test_admission_shadow_counts_returns_of_victims():
    """Write-all's cache takes every departed victim, the rule's only those written; a request's returns
    are one comparison (a key counts until it departs again), and a lead of z standard deviations
    moves the leader."""
    from tierkv.cache.admission_shadow import AdmissionShadow

    s = AdmissionShadow(1.0, z=1.0)
    s.resize(4)
    for k in range(4):
        s.departed(k, 1, k % 2 == 0)  # the rule writes 0 and 2
    s.departed(9, 1, None)  # on the tier already: both hold it, and it pushes 0 out of write-all's
    s.requested([0])  # the rule's cache alone holds 0
    s.requested([1, 9, 50])  # write-all's holds two of them, the rule's one; 50 never left
    s.requested([1])  # back already: not a return
    assert s.references == 2 and s.hits == pytest.approx([2.0, 2.0], abs=0.01)
    assert s.wins[0][1] == pytest.approx(1.0, abs=0.01) and s.wins[1][0] == pytest.approx(1.0, abs=0.01)
    assert s.leader == 0
    for k in range(10, 14):  # write-all's cache alone holds these when they come back
        s.departed(k, 1, False)
        s.requested([k])
    assert s.leader == 1 and s.switches == 1 and s.snapshot()["leader"] == "all"

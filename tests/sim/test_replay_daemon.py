"""The daemon and ``tierkv replay`` agree: one trace through a running daemon and through the simulator.

Each request goes through the real client in trace order: its hit is the longest cached prefix
(``lookup``), the hit blocks are leased (``acquire``: a use the host policy sees) and the missed
blocks are stored. The simulator replays the same trace over a host tier of the same capacity.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from tests.helpers import FAST_ENV, SMALL
from tierkv.client.slots import Slots
from tierkv.core.errors import BadRequest
from tierkv.core.keys import Namespace
from tierkv.integrations.vllm.missing import missing
from tierkv.integrations.vllm.plan import BlockIO
from tierkv.ops.replay_cli import daemon_config, tiers_for
from tierkv.sim.chat_trace import ChatTraceSpec, generate
from tierkv.sim.replay import ReplayConfig, TierSpec, Workload, parse_trace
from tierkv.sim.simulator import Simulator

BT = SMALL.block_tokens  # one trace block is one daemon block (8 KiB)
SLAB = 256 << 10
# The evictor demotes above the high watermark down to the low one; at 1.0 it never runs, and a store
# makes room exactly when the tier is full, as the simulator does.
RAW_STORED = 12 << 10  # an 8 KiB block stored raw takes 12 KiB of LMDB pages
FULL_ONLY = {**FAST_ENV, "TIERKV_HOST_HIGH_WATERMARK": "1.0", "TIERKV_HOST_LOW_WATERMARK": "1.0"}
SYNCHRONOUS = {**FULL_ONLY, "TIERKV_SERVER_SYNCHRONOUS": "true"}  # decided on the trace's clock


def chat_lines(seed: int) -> list[str]:
    """A small multi-turn chat trace (shared system prompts, turns extending their conversation), cut
    to whole blocks: the daemon keys full blocks only, and a partial last page would take room in the
    simulator and never hit (the generator renames it when the next turn fills it)."""
    spec = ChatTraceSpec(conversations=60, rate_per_s=1.0, mean_turns=4.0, think_s=20.0, system_prompts=4,
                         system_tokens=4 * BT, user_tokens=(BT, 4 * BT), reply_tokens=(BT // 2, 2 * BT),
                         block_tokens=BT, seed=seed)
    out = []
    for req in generate(spec):
        full = req["input_length"] // BT
        out.append(json.dumps({**req, "input_length": full * BT, "hash_ids": req["hash_ids"][:full]}))
    return out


FP = Namespace("test-model", SMALL).fingerprint  # the daemon's namespace of the clients here


def workload(lines: list[str]) -> Workload:
    """The trace's pages named as the daemon names the blocks ``drive`` stores (fingerprint + key):
    policies that sample chains by a hash of their keys sample the same ones in both."""
    w = Workload(parse_trace(lines), BT, BT)
    w.pages = [[FP + b"p%d" % p for p in pages] for pages in w.pages]  # type: ignore[misc]
    return w


@dataclass
class Drive:
    hits: list[int]      # per request: leading blocks cached
    evictions: int


def drive(d, w: Workload, store: str = "model", timeout: float | None = 0, clock: bool = False,
          ended_idle: list[bool] | None = None) -> Drive:
    """Every request of ``w`` through the daemon in order; the hit prefix is leased while the rest is
    stored.

    ``store``: ``model`` (the simulator's model): a block after the first miss that is still cached is
    leased too (a use, and safe from the store's evictions) and only the missing blocks are put;
    ``put``: every block past the hit is put (cached ones are deduplicated, untouched); ``engine``: as
    the vLLM connector's store pass within the step: the blocks past the hit that the lookup index
    holds are skipped, ``alloc`` for the others keeping the skipped ones, then ``commit`` of the others
    with the skipped ones as uses; ``gated``: as ``engine``, after offering the blocks past the hit to
    the daemon's store gate, which says how many leading ones to store (the rest are not touched), and
    where ``ended_idle`` says the engine was idle when the request ended, the run after them that the
    gate keeps for an idle engine is stored then, as the connector stores it.

    ``clock``: the daemon decides on the trace's clock (``server.synchronous``), moved before each
    request."""
    c = d.client()
    zeros = torch.zeros(SMALL.batch_shape(max(len(p) for p in w.pages)), dtype=SMALL.torch_dtype)
    hits = []
    for pages, req in zip(w.pages, w.requests):
        keys = [p[len(FP):] for p in pages]
        if clock:
            c.set_clock(req.timestamp_s)
        leases = [c.acquire(keys[:c.lookup(keys)])]
        hit = leases[0].count  # what an engine can use: the prefix that arrived in host memory
        hits.append(hit)
        rest = keys[hit:]
        if store == "model":
            for k in keys[hit:]:
                leases.append(c.acquire([k]))
            rest = [k for k, lease in zip(keys[hit:], leases[1:]) if not lease.count]
        idle: list[bytes] = []
        if rest and store == "gated":
            now, later = c.offer([(None, rest, hit, False)])[0]
            rest, idle = rest[:now], (rest[now:later] if ended_idle is not None and ended_idle[len(hits) - 1] else [])
        for run in (rest, idle):
            parent = keys[keys.index(run[0]) - 1] if run and run[0] != keys[0] else None
            if run and store in ("engine", "gated"):
                todo = missing([BlockIO("r", run, list(range(len(run))), parent=parent)], c.cached)
                with c.alloc(len(todo.keys), timeout=timeout, keep=todo.uses) if todo.keys else Slots(c, []) as slots:
                    slots.commit(todo.keys, chains=todo.chains, uses=todo.uses)
            elif run:
                c.put(run, zeros[:len(run)], timeout=timeout, parent=parent)
            if run is rest:
                for lease in leases:
                    lease.release()
                c.request_finished(keys, req.output_tokens)
    evictions = c.stats()["tiers"]["host"]["evictions"]
    c.close()
    return Drive(hits, evictions)


def simulate(w: Workload, policy: str, cap: int, page_costs: bool = True, store_gate: str = "all") -> list[int]:
    """Per request, the leading blocks the simulator hits over one host tier of ``cap`` bytes."""
    cfg = ReplayConfig(tiers=[TierSpec("host", cap)], page_tokens=BT, trace_block_tokens=BT,
                       kv_bytes_per_token=SMALL.block_bytes // BT, page_costs=page_costs, store_gate=store_gate)
    sim = Simulator(w, policy, tiers_for(policy, cfg, daemon_config(None), "all"))
    hits: list[int] = []
    serve = sim._serve

    def counted(pages, toks, hit_tokens):
        loads = serve(pages, toks, hit_tokens)
        hits.append(sim._hit_tok // BT)
        return loads

    sim._serve = counted
    sim.run()
    return hits


def host_capacity(d) -> int:
    return int(d.stats()["tiers"]["host"]["capacity_bytes"])


def start(daemon_factory, blocks: int, policy: str | None, env: dict[str, str] = FULL_ONLY):
    args = ["--host-capacity", str(blocks * SMALL.block_bytes), "--slab-bytes", str(SLAB), "--no-disk"]
    return daemon_factory(args + (["--policy", policy] if policy else []), env=env)


@pytest.mark.parametrize("seed", [0, 1])
def test_lru_host_tier_hits_what_replay_predicts(daemon_factory, seed):
    """Plain LRU on the host tier alone: the same hit on every request. The daemon's pool holds whole
    slabs (130 blocks asked, 128 given): the simulator gets the capacity the daemon reports."""
    w = workload(chat_lines(seed))
    d = start(daemon_factory, 130, "lru")
    cap = host_capacity(d)
    assert cap == 128 * SMALL.block_bytes
    got = drive(d, w).hits
    want = simulate(w, "lru", cap)
    total = sum(len(p) for p in w.pages)
    assert 0.3 < sum(want) / total < 0.7  # eviction matters: an unbounded cache hits ~80%
    assert got == want


def test_watermarks_empty_the_tier_below_what_replay_models(daemon_factory):
    """With the default watermarks (0.95 / 0.85) the evictor keeps the tier between 85% and 95% full:
    the daemon hits less than the simulator at its full capacity, and no less than at 85% of it."""
    w = workload(chat_lines(0))
    d = start(daemon_factory, 128, "lru", env=FAST_ENV)
    cap = host_capacity(d)
    got = sum(drive(d, w).hits)
    full, low = sum(simulate(w, "lru", cap)), sum(simulate(w, "lru", int(cap * 0.85)))
    assert low <= got < full


def test_engine_store_path_hits_what_replay_predicts(daemon_factory):
    """As the vLLM connector stores: only the blocks past the hit that tierkv does not hold are
    allocated and committed; the cached ones are kept from the allocation's evictions and used."""
    w = workload(chat_lines(2))
    d = start(daemon_factory, 128, "lru")
    got = drive(d, w, store="engine").hits
    assert got == simulate(w, "lru", host_capacity(d))


def test_the_store_gate_decides_as_replay_does(daemon_factory):
    """Chat turns among long one-off requests that nothing reuses, stored as the vLLM connector stores
    them once the store gate is asked: the daemon's gate and replay's skip the same blocks (the one-offs'
    positions past any chat's, 32 blocks in, stop being stored), the requests that end with the engine
    idle (by replay's clock) store the same idle runs, and the host tier hits the same blocks on every
    request."""
    lines, rows = [], [json.loads(s) for s in chat_lines(4)]
    for i, row in enumerate(rows):
        lines.append(json.dumps(row))
        if i % 2 == 0:  # a one-off request of 48 blocks beside every other turn
            lines.append(json.dumps({**row, "input_length": 48 * BT, "output_length": 1,
                                     "hash_ids": [10**6 + 100 * i + j for j in range(48)]}))
    w = workload(lines)
    d = start(daemon_factory, 128, "lru")
    sim = Simulator(w, "lru", ReplayConfig(tiers=[TierSpec("host", host_capacity(d))], page_tokens=BT,
                                           trace_block_tokens=BT, kv_bytes_per_token=SMALL.block_bytes // BT,
                                           store_gate="predicted"))
    hits: list[int] = []
    serve = sim._serve

    def counted(pages, toks, hit_tokens):
        loads = serve(pages, toks, hit_tokens)
        hits.append(sim._hit_tok // BT)
        return loads

    sim._serve = counted
    res = sim.run()
    got = drive(d, w, store="gated", ended_idle=sim.ended_idle).hits
    gate = d.stats()["store_gate"]
    assert gate["skipped"] > 0.1 * gate["offered"]  # the one-offs' deep blocks stopped being stored
    assert (gate["offered"], gate["skipped"]) == (res.store_offered, res.store_skipped)
    assert 0 < res.store_idle <= gate["idle"] and 0 < sum(sim.ended_idle) < len(sim.ended_idle)
    assert got == hits


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_default_policy_hits_what_replay_predicts(daemon_factory, seed):
    """The default host policy (``attention`` with its LRU shadow) on the host tier alone, stored as the
    vLLM connector stores, the daemon deciding on the trace's clock (``server.synchronous``), replay
    without per-page costs (the daemon has its cost model): the same hits within 2% (-1.7%, -0.9%,
    +1.4%, -0.6% on the four traces), the part left for what the two still count apart: replay tells
    the reuse model each request's whole chain, the daemon its fetched prefix and the stored runs, and a
    cached block between two stored runs starts a chain of its own there."""
    lines = chat_lines(seed)
    d = start(daemon_factory, 128, None, env=SYNCHRONOUS)
    got = sum(drive(d, workload(lines), store="engine", clock=True).hits)
    want = sum(simulate(workload(lines), "default", host_capacity(d), page_costs=False))
    assert got == pytest.approx(want, rel=0.02), f"daemon {got} blocks, replay {want}"


def simulate_two(w: Workload, policy: str, host: int, disk: int, admission: str, compression: float,
                 page_costs: bool = True) -> int:
    """Hit blocks the simulator gives a host tier of ``host`` bytes over an inclusive disk of ``disk``
    (a block taking ``1 / compression`` of its bytes there)."""
    cfg = ReplayConfig(tiers=[TierSpec("host", host), TierSpec("disk", disk, inclusive=True, compression=compression)],
                       page_tokens=BT, trace_block_tokens=BT, kv_bytes_per_token=SMALL.block_bytes // BT,
                       page_costs=page_costs)
    run = tiers_for(policy, cfg, daemon_config(None), admission)
    return round(Simulator(w, policy, run).run().token_hit_rate * sum(len(p) for p in w.pages))


@pytest.mark.parametrize("policy", ["lru", "default"])
def test_two_tiers_hit_what_replay_predicts(daemon_factory, policy):
    """Host memory over a disk four times its size (blocks stored raw, so the simulator knows the bytes
    each takes there), both evicting only when full, the daemon deciding on the trace's clock with each
    store waiting for the demotion it forced (``server.synchronous``): the same hits every run, within 2%
    of replay's. Write-behind is off: it puts disk copies of blocks still in host memory, as many as the
    writer finds time for, which replay does not model; so are spare writes (every victim written while
    the writer has nothing queued): replay runs without a modelled writer, so the admission rule decides
    every victim in both. Stored as the vLLM connector stores. What still differs is how host memory
    makes room: the daemon drops blocks it holds on disk too before any other, and writes dirty victims
    back a slab at a time; replay takes the policy's victims one by one (the daemon hits 0.8% less with
    the default policies, 1.5% more with LRU, on this trace)."""
    lines = chat_lines(0)
    env = {**SYNCHRONOUS, "TIERKV_HOST_WRITE_BEHIND": "false", "TIERKV_DISK_CODEC": "raw",
           "TIERKV_DISK_SPARE_WRITES": "false", "TIERKV_DISK_HIGH_WATERMARK": "1.0",
           "TIERKV_DISK_LOW_WATERMARK": "1.0"}
    if policy == "lru":
        env.update(TIERKV_DISK_POLICY="lru", TIERKV_DISK_ADMISSION="all")
    args = ["--host-capacity", str(96 * SMALL.block_bytes), "--slab-bytes", str(SLAB),
            "--disk-capacity", str(384 * RAW_STORED)] + (["--policy", "lru"] if policy == "lru" else [])
    d = daemon_factory(args, env=env)
    tiers = d.stats()["tiers"]
    run = drive(d, workload(lines), store="engine", timeout=None, clock=True)  # a store waits for the writer: no block dropped unwritten
    got = sum(run.hits)
    disk = d.stats()["tiers"]["disk"]
    assert disk["evictions"] > 0 and disk["used_bytes"] == disk["blocks"] * RAW_STORED
    want = simulate_two(workload(lines), policy, tiers["host"]["capacity_bytes"], tiers["disk"]["capacity_bytes"],
                        "all" if policy == "lru" else daemon_config(None).disk.admission,
                        SMALL.block_bytes / RAW_STORED, page_costs=policy == "lru")
    assert got == pytest.approx(want, rel=0.02), f"daemon {got} blocks, replay {want}"
    again = daemon_factory(args, env=env)
    assert sum(drive(again, workload(lines), store="engine", timeout=None, clock=True).hits) == got  # one trace, one result


def test_only_a_synchronous_daemon_has_a_clock_to_set(daemon_factory):
    """The clock moves forward, by numbers, on a ``server.synchronous`` daemon only; bad values are
    refused with the reason and change nothing."""
    with start(daemon_factory, 64, "lru").client() as c:
        with pytest.raises(BadRequest, match="server.synchronous"):
            c.set_clock(1.0)
    with start(daemon_factory, 64, "lru", env=SYNCHRONOUS).client() as c:
        c.set_clock(10.0)
        for bad, why in ((5.0, "does not go back"), ("soon", "finite number"), (float("nan"), "finite number"),
                         (True, "finite number"), (None, "finite number")):
            with pytest.raises(BadRequest, match=why):
                c.set_clock(bad)
        c.set_clock(10.0)
        c.set_clock(12.5)


def test_a_synchronous_daemon_gives_one_result_per_trace(daemon_factory):
    """At the default watermarks (the evictor demotes between them) and beside a spinning process, two
    synchronous daemons fed one trace hit the same blocks on every request: each store and commit that
    kicks the evictor waits for its pass."""
    env = {**FAST_ENV, "TIERKV_SERVER_SYNCHRONOUS": "true", "TIERKV_HOST_WRITE_BEHIND": "false",
           "TIERKV_DISK_SPARE_WRITES": "false"}
    args = ["--host-capacity", str(96 * SMALL.block_bytes), "--slab-bytes", str(SLAB),
            "--disk-capacity", str(384 * RAW_STORED)]
    w = workload(chat_lines(0))
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        runs = [drive(daemon_factory(args, env=env), w, store="engine", timeout=None, clock=True) for _ in range(2)]
    finally:
        spinner.kill()
        spinner.wait()
    assert runs[0].hits == runs[1].hits and runs[0].evictions > 0

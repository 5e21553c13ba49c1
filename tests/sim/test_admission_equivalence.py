"""The daemon's decisions and ``tierkv replay`` agree on one trace: the same hits, the same blocks in
each tier after every request (so the same evictions), the same admissions to disk.

The daemon side is its decision objects, built by the daemon's own start-up (``make_host_policy``,
``make_disk_policy``, ``make_admission``: :mod:`tierkv.cache.wiring`) over a block table, a slab
allocator, :class:`HostManager` and :class:`DiskManager`, driven request by request as the daemon's
paths drive them, with each transfer done in place: the request names its chain (the reuse models
learn from it), the blocks any tier holds are leased (a use: ``touch``), the blocks on disk only are
loaded, the missing ones stored, and the evictor demotes at watermarks 1.0 (victims admitted by the
rule are written to disk, the others dropped) before the leases end. The simulator replays the same
trace over tiers of the same sizes with the same policies and rule.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

import pytest

from tests.helpers import SMALL
from tierkv.cache.block import Block
from tierkv.cache.disk_manager import DiskManager
from tierkv.cache.host_manager import HostManager
from tierkv.cache.host_outflow import HostOutflow
from tierkv.cache.reuse import History
from tierkv.cache.table import BlockTable
from tierkv.cache.tier_changes import TierChanges
from tierkv.cache.wiring import host_reuse
from tierkv.core.keys import Namespace
from tierkv.daemon.blockstore import HISTORY_ENTRIES
from tierkv.daemon.config import Config
from tierkv.daemon.startup import make_admission, make_disk_policy, make_host_policy
from tierkv.sim.chat_trace import ChatTraceSpec, generate
from tierkv.sim.replay import ReplayConfig, TierSpec, Workload, parse_trace
from tierkv.sim.simulator import Simulator
from tierkv.tiers.disk import stored_size
from tierkv.tiers.host import SlabAllocator, slot_size_for

BT = SMALL.block_tokens
BLOCK = SMALL.block_bytes
STORED = stored_size(BLOCK)  # a block stored raw takes this many bytes of LMDB pages
FP = Namespace("equivalence", SMALL).fingerprint
HOST_BLOCKS, DISK_BLOCKS = 96, 192
# The daemon's rule remembers 32,768 departures: no block of a short trace falls off that list, so
# every class keeps its prior and ``predicted`` writes every victim. Both sides use a short list.
GHOST = 64


def trace(seed: int = 0) -> list[str]:
    """About 240 chat turns (shared system prompts, each turn extending its conversation) and, between
    them, one-shot prompts of their own."""
    spec = ChatTraceSpec(conversations=50, rate_per_s=1.0, mean_turns=4.0, think_s=15.0, system_prompts=3,
                         system_tokens=3 * BT, user_tokens=(BT, 3 * BT), reply_tokens=(BT // 2, 2 * BT),
                         block_tokens=BT, seed=seed)
    rng = random.Random(seed)
    out, fresh = [], 10**9
    for req in generate(spec):
        full = req["input_length"] // BT  # whole blocks: the daemon keys full blocks only
        out.append({**req, "input_length": full * BT, "hash_ids": req["hash_ids"][:full]})
        if rng.random() < 0.25:
            n = rng.randint(1, 4)
            out.append({"timestamp": req["timestamp"], "input_length": n * BT, "output_length": 1,
                        "hash_ids": list(range(fresh, fresh + n))})
            fresh += n
    return [json.dumps(r) for r in out]


@dataclass
class Step:
    """One request's outcome: blocks hit per tier, then the blocks each tier holds."""

    host_hits: int
    disk_hits: int
    host: frozenset[int]
    disk: frozenset[int]


def _cfg(admission: str) -> Config:
    cfg = Config()
    cfg.host.policy = cfg.disk.policy = "lru"
    cfg.disk.admission = admission
    cfg.host.high_watermark = cfg.host.low_watermark = 1.0
    cfg.disk.high_watermark = cfg.disk.low_watermark = 1.0
    return cfg


class DaemonDecisions:
    """The daemon's decision objects, wired by its start-up, with transfers done in place."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.table = BlockTable()
        self.history = History(max_entries=HISTORY_ENTRIES)
        self.host_reuse = host_reuse(HISTORY_ENTRIES)
        self.admission = make_admission(cfg, self.history, HISTORY_ENTRIES)
        self.admission.update(ghost_entries=GHOST)
        changes = TierChanges()
        self.diskm = DiskManager(self.table, make_disk_policy(cfg, self.history, self.admission.evict_model),
                                 cfg.disk, lambda: DISK_BLOCKS * STORED, stored_size, changes)
        self.slot = slot_size_for(BLOCK)
        # the pool holds a request beyond the tier's limit: the evictor brings it back under the limit
        pool = SlabAllocator((HOST_BLOCKS + 64) * self.slot, 8 * self.slot)
        self.hostm = HostManager(self.table, pool, make_host_policy(cfg, self.history, self.host_reuse),
                                 self.diskm, self.host_reuse, self.admission, (cfg.host, cfg.disk), lambda: False,
                                 changes)
        self.hostm.limit = HOST_BLOCKS * self.slot
        self.outflow = HostOutflow(self.hostm, self.admission)

    def request(self, pages: list[int], output_tokens: int | None) -> Step:
        fks = [FP + p.to_bytes(8, "little") for p in pages]
        now = time.monotonic()
        predicted = self.cfg.disk.admission == "predicted"
        self.host_reuse.requested(fks, now)  # Signals.requested: the request names its chain
        if predicted:
            self.admission.requested(fks, now)
        host_hits = disk_hits = 0
        prefix = True
        leased: list[Block] = []
        incoming: list[tuple[bytes, Block | None]] = []
        for fk in fks:
            b = self.table.get(fk)
            prefix = prefix and b is not None
            if b is None:
                incoming.append((fk, None))
                continue
            host_hits += prefix and b.host_off is not None
            disk_hits += prefix and b.host_off is None
            self.hostm.touch(b)  # a lease is a use
            self.hostm.lease(b)
            leased.append(b)
            if b.host_off is None:
                incoming.append((fk, b))  # on disk only: loaded into host memory
        self._bring_in(fks, incoming, leased, now)
        self._evict()
        for b in leased:
            self.hostm.unlease(b)
        self.host_reuse.request_finished(fks, now, output_tokens)
        self.admission.request_finished(fks, now, output_tokens)
        held = [(int.from_bytes(b.fk[len(FP):], "little"), b) for b in self.table.records()]
        return Step(host_hits, disk_hits, frozenset(p for p, b in held if b.host_off is not None),
                    frozenset(p for p, b in held if b.on_disk))

    def _bring_in(self, fks: list[bytes], incoming: list[tuple[bytes, Block | None]], leased: list[Block],
                  now: float) -> None:
        """Loads and stores in request order: a slot each, inserted into the host order and used."""
        stored: list[bytes] = []
        for fk, b in incoming:
            off = self.hostm.pool.alloc(self.slot)
            assert off is not None
            if b is None:
                i = fks.index(fk)
                b = self.table.add(Block(fk, BLOCK, fks[i - 1] if i else None))
                self.hostm.committed(b, off, b.parent)
                self.hostm.lease(b)  # the client holds its new blocks until the request ends
                leased.append(b)
                stored.append(fk)
            else:
                self.hostm.kept(b, off, b.parent, None)
                self.hostm.policy.on_access(fk)
        self.host_reuse.stored(stored, now)
        if self.cfg.disk.admission == "predicted":
            self.admission.stored(stored, now)

    def _evict(self) -> None:
        """The evictor: demote above the watermark; the disk writer makes room for each block it writes."""
        dirty = self.outflow.demotion(False)
        for b in dirty:
            _deletes, reserved = self.diskm.prepare_store([b])
            self.diskm.complete_store(b, BLOCK)
            self.diskm.store_settled(reserved, failed=False)
        self.outflow.demoted(dirty)


def simulate(lines: list[str], cfg: Config) -> tuple[list[Step], Simulator]:
    w = Workload(parse_trace(lines), BT, BT)
    tiers = [TierSpec("host", HOST_BLOCKS * BLOCK, policy="lru"),
             TierSpec("disk", DISK_BLOCKS * STORED, compression=BLOCK / STORED, inclusive=True, policy="lru",
                      admission=cfg.disk.admission)]
    # the rule remembers as many blocks and departures as the daemon's
    rule = {"shadow_rate": cfg.disk.shadow_rate, "ghost_entries": GHOST, "max_records": HISTORY_ENTRIES}
    sim = Simulator(w, "lru", ReplayConfig(tiers=tiers, page_tokens=BT, trace_block_tokens=BT,
                                           kv_bytes_per_token=BLOCK // BT, admission_settings=rule))
    steps: list[Step] = []
    serve = sim._serve

    def recorded(pages, toks, hit_tokens):
        loads = serve(pages, toks, hit_tokens)
        held = sim.stack.held
        steps.append(Step(loads[0] // BLOCK, loads[1] // BLOCK, frozenset(p for p, m in held.items() if m & 1),
                          frozenset(p for p, m in held.items() if m & 2)))
        return loads

    sim._serve = recorded
    sim.run()
    return steps, sim


@pytest.mark.parametrize("admission", ["reused", "predicted", "all"])
def test_daemon_decisions_and_replay_agree(admission):
    lines = trace()
    cfg = _cfg(admission)
    want, sim = simulate(lines, cfg)
    daemon = DaemonDecisions(cfg)
    w = Workload(parse_trace(lines), BT, BT)
    got = [daemon.request(pages, req.output_tokens if req.output_given else None)
           for pages, req in zip(w.pages, w.requests)]
    assert len(w.requests) > 200
    for i, (g, s) in enumerate(zip(got, want)):
        assert g == s, f"request {i}: daemon {g}, replay {s}"
    rule = sim.rules[1]
    assert rule is not None
    assert (daemon.admission.admitted, daemon.admission.rejected) == (rule.admitted, rule.rejected)
    # the trace exercises what is compared: hits in both tiers, host and disk evictions, both decisions
    assert sum(s.host_hits for s in want) > 0 and sum(s.disk_hits for s in want) > 0
    assert daemon.hostm.stats.evictions > 0 and daemon.diskm.stats.evictions > 0
    assert rule.admitted > 0 and (rule.rejected > 0 or admission == "all")

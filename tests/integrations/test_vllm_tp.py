"""Tensor parallelism on the vLLM connector's scheduler side, against a real daemon: each rank stores its
heads under its own namespace, and the scheduler counts a block as cached, and as in host memory, only
where every rank holds it."""

from __future__ import annotations

import torch

from tests.integrations.test_vllm_plan import BT, LAYOUT, Cached, NewReq, Req, Step, pages, prefill
from tierkv.core.keys import Namespace
from tierkv.integrations.vllm.link import Link
from tierkv.integrations.vllm.plan import BlockIO, PlanGroup, Planner
from tierkv.integrations.vllm.ranks import merge_plans
from tierkv.integrations.vllm.transfer import Transfers

TP = 2
MODEL = "vllm-tp"
TOKENS = list(range(5000, 5000 + 4 * BT + 3))  # 4 full blocks and a partial one


def rank_link(daemon, rank: int, model: str = MODEL) -> Link:
    return Link(daemon.socket, model=model, layout=LAYOUT, tp_rank=rank, tp_size=TP)


def planner(daemon, models: tuple[str, ...] = (MODEL,)) -> Planner:
    """The scheduler side as the connector builds it for TP=2: per KV cache group, one connection per rank."""
    return Planner([PlanGroup(rank_link(daemon, 0, m), Namespace(m, LAYOUT, 0, TP), ranks=(rank_link(daemon, 1, m),))
                    for m in models], BT)


def store(daemon, rank: int, io: BlockIO, n: int, seed: int, model: str = MODEL) -> None:
    """Rank ``rank``'s worker stores the first ``n`` blocks of a planned store."""
    part = BlockIO(io.req_id, io.keys[:n], io.block_ids[:n], parent=io.parent, tokens=io.tokens[:n * BT * 4])
    t = Transfers(rank_link(daemon, rank, model), pages(seed=seed))
    t.store([part])
    assert t.take_counters().store_errors == 0


def test_a_block_counts_as_cached_only_where_every_rank_holds_it(daemon):
    sched = planner(daemon)
    n, plan = prefill(sched, Req("a", TOKENS), [4, 9, 2, 7, 5])
    assert n == 0
    (io,) = plan.stores
    store(daemon, 0, io, 4, seed=1)
    store(daemon, 1, io, 2, seed=2)  # rank 1 stores only half of the prefix
    rank0 = Planner.single(rank_link(daemon, 0), Namespace(MODEL, LAYOUT, 0, TP), BT)
    assert rank0.matched_tokens(Req("r0", TOKENS), 0) == (4 * BT, False)  # rank 0 alone: all of it

    n, plan = prefill(planner(daemon), Req("b", TOKENS), [1, 3, 6, 8, 10])
    assert n == 2 * BT  # the hit stops where rank 1 stops
    assert [x.block_ids for x in plan.loads] == [[1, 3]] and [x.block_ids for x in plan.stores] == [[6, 8]]

    store(daemon, 1, io, 4, seed=2)  # rank 1 catches up
    n, plan = prefill(planner(daemon), Req("c", TOKENS), [1, 3, 6, 8, 10])
    assert n == 4 * BT and [x.block_ids for x in plan.loads] == [[1, 3, 6, 8]] and not plan.stores
    for rank, seed in ((0, 1), (1, 2)):  # each rank loads its own heads
        src, dst = pages(seed=seed), pages(seed=9)
        t = Transfers(rank_link(daemon, rank), dst)
        t.load(plan.loads)
        assert not t.take_load_errors()
        assert all(torch.equal(s[a], d[b]) for s, d in zip(src.caches, dst.caches)
                   for a, b in ((4, 1), (9, 3), (2, 6), (7, 8)))


def test_a_prefix_on_disk_for_one_rank_loads_asynchronously(daemon):
    """Rank 1's blocks are on disk (the daemon restarted), rank 0's in host memory: the load is
    asynchronous and the daemon starts promoting rank 1's blocks."""
    _, plan = prefill(planner(daemon), Req("a", TOKENS), [0, 1, 2, 3, 4])
    (io,) = plan.stores
    store(daemon, 1, io, 4, seed=2)
    daemon.stop()
    daemon.start()
    assert daemon.stats()["tiers"]["host"]["blocks"] == 0
    store(daemon, 0, io, 4, seed=1)
    rank0 = Planner.single(rank_link(daemon, 0), Namespace(MODEL, LAYOUT, 0, TP), BT)
    assert rank0.matched_tokens(Req("r0", TOKENS), 0) == (4 * BT, False)  # rank 0 alone: in host memory
    sched = planner(daemon)
    assert sched.matched_tokens(Req("b", TOKENS), 0) == (4 * BT, True)


def test_ranks_multiply_with_groups_every_rank_of_every_group_holds_the_hit(daemon):
    models = ("vllm-tp#g0", "vllm-tp#g1")
    sched = planner(daemon, models)
    req = Req("a", TOKENS)
    assert sched.matched_tokens(req, 0) == (0, False)
    sched.allocated(req, ([0, 1, 2, 3, 4], [5, 6, 7, 8, 9]), 0)
    stores = sched.step(Step([NewReq("a", ([0, 1, 2, 3, 4], [5, 6, 7, 8, 9]), 0)], Cached(),
                             {"a": len(TOKENS)})).stores
    assert [io.group for io in stores] == [0, 1]
    for g, (io, model) in enumerate(zip(stores, models)):
        for rank in range(TP):
            store(daemon, rank, io, 1 if (g, rank) == (1, 1) else 4, seed=g + rank, model=model)
    # several groups load beside the step; group 1's rank 1 holds one block
    assert planner(daemon, models).matched_tokens(Req("b", TOKENS), 0) == (BT, True)
    store(daemon, 1, stores[1], 4, seed=2, model=models[1])
    assert planner(daemon, models).matched_tokens(Req("c", TOKENS), 0) == (4 * BT, True)


def test_plans_merge_by_the_fewest_blocks_and_readiness_on_every_rank():
    a = {"count": 4, "fetch": 4, "ready": [True, True, True, True], "tiers": ["host"] * 4, "runs": [1]}
    b = {"count": 3, "fetch": 2, "ready": [True, False, True], "tiers": ["host", "disk", "host"], "runs": [2]}
    assert merge_plans([a]) is a
    assert merge_plans([a, b]) == {"count": 3, "fetch": 2, "ready": [True, False, True],
                                   "tiers": ["host"] * 3, "runs": [1]}

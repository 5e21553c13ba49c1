"""The connector's store pass against a real daemon, without vLLM: blocks past a request's hit that
tierkv already holds are neither copied nor given a slot, the blocks stored continue them, the
allocation evicts none of them, and the commit counts each as a use."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from tests.helpers import FAST_ENV
from tests.integrations.test_vllm_plan import BT, LAYOUT, Req, link, prefill
from tierkv.core.keys import Namespace, chain_keys
from tierkv.integrations.vllm.committer import StoreCommitter
from tierkv.integrations.vllm.pages import VllmPages
from tierkv.integrations.vllm.plan import Planner
from tierkv.integrations.vllm.transfer import Transfers

NS = Namespace("vllm-plan", LAYOUT)
SLOTS = 16  # the host tier: two slabs of eight 32 KiB blocks
# LRU over the host tier alone, evicting only when full (the evictor never runs ahead)
ENV = {**FAST_ENV, "TIERKV_HOST_HIGH_WATERMARK": "1.0", "TIERKV_HOST_LOW_WATERMARK": "1.0"}
ARGS = ["--host-capacity", str(SLOTS * LAYOUT.block_bytes), "--slab-bytes", str(8 * LAYOUT.block_bytes),
        "--no-disk", "--policy", "lru"]


class RecordingPages(VllmPages):
    """vLLM's CPU pages, remembering which blocks each store pass copied out."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        super().__init__([torch.randn(num_blocks, 2, BT, 64, generator=g) for _ in range(2)], 32)
        self.gathered: list[list[int]] = []

    def gather(self, block_ids: Sequence[int], out: Sequence[torch.Tensor]) -> None:
        self.gathered.append(list(block_ids))
        super().gather(block_ids, out)

    def block(self, block_id: int) -> torch.Tensor:
        """vLLM block ``block_id`` in tierkv's block layout."""
        out = [torch.empty(LAYOUT.block_shape)]
        VllmPages.gather(self, [block_id], out)
        return out[0]


def _full_tier_with_blocks_2_and_4_oldest(d, tokens: list[int]) -> tuple[list[bytes], torch.Tensor]:
    """Blocks 2 and 4 of the prompt ``tokens`` cached (not 0: the request's hit is 0 blocks), least
    recently used, and the tier filled up behind them; returns the prompt's keys and those two blocks."""
    keys = chain_keys(NS.fingerprint, tokens, BT)
    early = torch.randn(LAYOUT.batch_shape(2))
    with d.client(model="vllm-plan", layout=LAYOUT) as c:
        assert c.stats()["tiers"]["host"]["capacity_bytes"] == SLOTS * LAYOUT.block_bytes
        c.put(keys[2:3], early[:1], parent=keys[1])
        c.put(keys[4:5], early[1:], parent=keys[3])
        filler = c.block_keys(list(range(500_000, 500_000 + (SLOTS - 2) * BT)))
        c.put(filler, torch.zeros(LAYOUT.batch_shape(len(filler))))
        assert c.stats()["tiers"]["host"]["blocks"] == SLOTS and c.cached(keys[:6]) == [False, False, True,
                                                                                         False, True, False]
    return keys, early


@pytest.mark.parametrize("behind", [False, True], ids=["in-step", "committer"])
def test_a_store_gathers_and_commits_only_the_blocks_tierkv_lacks(daemon_factory, behind):
    """Six new blocks of which tierkv holds two, the two least recently used of a full tier: the step
    copies the other four into four slots (four evictions, none of the two), the four chains continue
    the cached blocks, and the two count as uses (a later request hits all six)."""
    d = daemon_factory(ARGS, env=ENV)
    tokens = list(range(3000, 3000 + 6 * BT + 1))
    keys, early = _full_tier_with_blocks_2_and_4_oldest(d, tokens)
    src = RecordingPages(16, seed=31)
    committer = StoreCommitter(link(d), BT) if behind else None
    t = Transfers(link(d), src, committer=committer)
    n, plan = prefill(Planner.single(link(d), NS, BT), Req("a", tokens), [7, 8, 9, 10, 11, 12, 13])
    assert n == 0 and plan.stores[0].keys == keys[:6]

    staged = t.stage(plan.stores)
    assert staged is not None and src.gathered == [[7, 8, 10, 12]]
    assert staged.keys == [keys[0], keys[1], keys[3], keys[5]] and len(staged.slots) == 4
    assert staged.chains == [(0, None), (2, keys[2]), (3, keys[4])] and staged.uses == [keys[2], keys[4]]
    t.commit(staged)
    if committer is not None:
        assert committer.flush()
    counters = t.take_counters()
    assert (counters.new_blocks, counters.store_deduplicated, counters.stored_tokens) == (4, 2, 4 * BT)

    with d.client(model="vllm-plan", layout=LAYOUT) as c:
        host = c.stats()["tiers"]["host"]
        reserved = len(committer._free) if committer is not None else 0  # refilled behind the commit
        assert host["evictions"] == 4 + reserved  # the fillers least recently used, none of blocks 2 and 4
        assert c.lookup(keys) == 6
        got = c.get(keys[:6])
    for i, block in ((0, 7), (1, 8), (3, 10), (5, 12)):
        assert torch.equal(got[i], src.block(block))
    assert torch.equal(got[2], early[0]) and torch.equal(got[4], early[1])
    if committer is not None:
        committer.close()


def test_a_cached_block_gone_before_the_commit_leaves_a_hole_never_wrong_data(daemon_factory):
    """Block 2 is deleted between the check and the commit: the commit stores 0, 1, 3 and 5 as
    gathered, block 2 is a miss (the prefix ends before it), and no key holds another block's bytes."""
    d = daemon_factory(ARGS, env=ENV)
    tokens = list(range(4000, 4000 + 6 * BT + 1))
    keys, early = _full_tier_with_blocks_2_and_4_oldest(d, tokens)
    src = RecordingPages(16, seed=32)
    t = Transfers(link(d), src)
    _, plan = prefill(Planner.single(link(d), NS, BT), Req("b", tokens), [0, 1, 2, 3, 4, 5, 6])
    staged = t.stage(plan.stores)
    assert staged is not None and staged.uses == [keys[2], keys[4]]
    with d.client(model="vllm-plan", layout=LAYOUT) as c:
        assert c.delete(keys[2:3]) == 1
        t.commit(staged)
        assert t.take_counters().new_blocks == 4
        assert c.lookup(keys) == 2 and c.cached(keys[:6]) == [True, True, False, True, True, True]
        got = c.get(keys[3:6])
    assert torch.equal(got[0], src.block(3)) and torch.equal(got[1], early[1]) and torch.equal(got[2], src.block(5))


def test_a_requests_cache_salt_is_the_tenant_its_stored_blocks_count_for(daemon_factory, tmp_path):
    """Two requests with a cache_salt each and one without, stored in one pass: each salted request's new
    blocks count against its tenant in the daemon (the quota accounts), the other's against none."""
    from tests.daemon.test_control import TOKEN, _call
    from tests.daemon.test_metrics import free_port

    token, port = tmp_path / "token", free_port()
    token.write_text(TOKEN)
    token.chmod(0o600)
    d = daemon_factory(ARGS + ["--metrics-addr", str(port), "--control-token-file", str(token)], env=ENV)
    for tenant in ("tenant-a", "tenant-b"):
        assert _call(port, "POST", "quotas", {"tenant": tenant, "host": 1 << 30})[0] == 200
    src = RecordingPages(16, seed=5)
    planner, t = Planner.single(link(d), NS, BT), Transfers(link(d), src)
    stores = []
    for rid, salt, start, ids in (("a", "tenant-a", 10_000, [1, 2]), ("b", "tenant-b", 20_000, [3]),
                                  ("c", None, 30_000, [4, 5])):
        _n, plan = prefill(planner, Req(rid, list(range(start, start + len(ids) * BT + 1)), cache_salt=salt), ids)
        stores += plan.stores
    assert [io.tenant for io in stores] == ["tenant-a", "tenant-b", None]
    staged = t.stage(stores)
    assert staged is not None and staged.tenants == [(0, "tenant-a"), (2, "tenant-b"), (3, None)]
    t.commit(staged)
    with d.client(model="vllm-plan", layout=LAYOUT) as c:
        tenants = c.stats()["tenants"]
    assert {k: v["used"]["host"] for k, v in tenants.items()} == {"tenant-a": 2 * LAYOUT.block_bytes,
                                                                 "tenant-b": LAYOUT.block_bytes}

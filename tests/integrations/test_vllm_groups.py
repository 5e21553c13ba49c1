"""Models with several KV cache groups, sliding windows and MLA, through the vLLM connector's plain parts
against a real daemon (vLLM's own spec classes, no engine): each group in its own namespace, a position
stored for all groups or none, a partial entry a miss, a sliding window loading only what it reads, a
latent page bit-exact, and no group's block ever served as another's."""

from __future__ import annotations

import time

import pytest
import torch

from tests.integrations.test_vllm_plan import Cached, NewReq, Req, Step
from tierkv.core.keys import Namespace
from tierkv.core.layout import Layout
from tierkv.integrations.vllm.grouped import GroupTransfers
from tierkv.integrations.vllm.groups import GroupSpec, find_hit, group_specs, namespace_model
from tierkv.integrations.vllm.link import Link
from tierkv.integrations.vllm.pages import VllmPages
from tierkv.integrations.vllm.plan import PlanGroup, Planner
from tierkv.integrations.vllm.transfer import Transfers

kvi = pytest.importorskip("vllm.v1.kv_cache_interface")

BT, HEADS, DIM, WINDOW = 32, 2, 32, 64  # a window of 64 tokens reaches back 63: two 32-token blocks
LAYOUT = Layout(2, HEADS, DIM, BT, "float32")
NULL = 0  # vLLM's null block


def spec(kind: str = "full", **kw):
    common = dict(block_size=BT, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float32)
    if kind == "sliding":
        return kvi.SlidingWindowSpec(**common, sliding_window=WINDOW, **kw)
    if kind == "mla":
        return kvi.MLAAttentionSpec(**{**common, "num_kv_heads": 1, "head_size": 576, "dtype": torch.bfloat16})
    return kvi.FullAttentionSpec(**common, **kw)


def config(*specs):
    groups = [kvi.KVCacheGroupSpec([f"model.layers.{2 * i + j}.attn" for j in range(2)], s) for i, s in enumerate(specs)]
    return kvi.KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


def gemma_like() -> list[GroupSpec]:
    groups, why = group_specs(config(spec("sliding"), spec("full")))
    assert not why
    return groups


def test_vllms_specs_become_groups_with_their_own_namespaces_or_a_reason():
    sw, full = gemma_like()
    assert (sw.kind, sw.window, sw.reach, sw.layout) == ("sliding", WINDOW, WINDOW - 1, LAYOUT)
    assert (full.kind, full.window, full.reach, full.layout) == ("full", None, None, LAYOUT)
    assert [sw.first_needed(n) for n in (1, 2, 3, 6)] == [0, 0, 1, 4]  # the window's two blocks
    names = namespace_model("gemma", [sw, full])
    assert names[0].startswith("gemma#g0.sliding64.") and names[1].startswith("gemma#g1.full.")
    assert Namespace(names[0], LAYOUT).fingerprint != Namespace(names[1], LAYOUT).fingerprint  # same layout
    (one,), _ = group_specs(config(spec()))
    assert namespace_model("llama", [one]) == ["llama"]  # one full-attention group: the plain model id
    (mla,), _ = group_specs(config(spec("mla")))
    assert mla.kind == "mla" and mla.layout == Layout(2, 1, 576, BT, "bfloat16", kind="latent")
    (fp8,), _ = group_specs(config(kvi.FullAttentionSpec(block_size=BT, num_kv_heads=HEADS, head_size=DIM,
                                                         dtype=torch.uint8)), cache_dtype="fp8_e5m2")
    assert fp8.layout.dtype == "float8_e5m2"  # named by the fp8 format the pages hold, never re-quantized
    mamba = kvi.MambaSpec(block_size=BT, shapes=((4, 8),), dtypes=(torch.float32,))
    refusals = {
        "Mamba": config(spec(), mamba),
        "chunked local": config(kvi.ChunkedLocalAttentionSpec(block_size=BT, num_kv_heads=HEADS, head_size=DIM,
                                                               dtype=torch.float32, attention_chunk_size=64)),
        "keeps scales in the pages": config(spec(kv_quant_mode=kvi.KVQuantMode.INT8_PER_TOKEN_HEAD)),
        "different block sizes": config(spec(), kvi.SlidingWindowSpec(block_size=2 * BT, num_kv_heads=HEADS,
                                                                      head_size=DIM, dtype=torch.float32,
                                                                      sliding_window=WINDOW)),
        "different head sizes": config(spec(head_size_v=DIM // 2)),
    }
    for needle, cfg in refusals.items():
        groups, why = group_specs(cfg)
        assert not groups and needle in why, (needle, why)


def test_a_hit_needs_every_full_groups_prefix_and_every_windows_blocks():
    sw, full = gemma_like()

    def lookup(present: set[int]):
        return lambda lo, hi: next((i - lo for i in range(lo, hi) if i not in present), hi - lo)

    every = set(range(10))
    assert find_hit([sw, full], [lookup(every), lookup(every)], 0, 8) == 8
    # the window of a hit at 8 reads blocks 6 and 7; blocks before may be gone from the sliding group
    assert find_hit([sw, full], [lookup({6, 7}), lookup(every)], 0, 8) == 8
    # block 7 missing in the sliding group: a hit at 7 reads 5 and 6, absent too; no hit ends past 5
    assert find_hit([sw, full], [lookup({0, 1, 2, 3, 4, 6}), lookup(every)], 0, 8) == 5
    # a full-attention gap at 3 caps the hit, whatever the window holds
    assert find_hit([sw, full], [lookup(every), lookup(every - {3})], 0, 8) == 3
    # vLLM holds 5 blocks itself: the window of a hit at 6 starts at 5, 4 need not be in tierkv
    assert find_hit([sw], [lookup({5})], 5, 6) == 6


def cpu_pages(seed: int, nb: int = 16) -> VllmPages:
    g = torch.Generator().manual_seed(seed)
    return VllmPages([torch.randn(nb, HEADS, BT, 2 * DIM, generator=g) for _ in range(2)], DIM)


class Model:
    """A Gemma-like model (a sliding-window group and a full-attention group of identical layouts) on one
    daemon: its scheduler-side planner and a worker's transfers over two groups of CPU pages."""

    def __init__(self, daemon, seed: int, groups: list[GroupSpec] | None = None, model: str = "gemma") -> None:
        self.daemon = daemon
        self.groups = groups or gemma_like()
        self.models = namespace_model(model, self.groups)
        link = [lambda m=m, g=g: Link(daemon.socket, model=m, layout=g.layout) for m, g in zip(self.models, self.groups)]
        self.planner = Planner([PlanGroup(mk(), Namespace(m, g.layout), g)
                                for mk, m, g in zip(link, self.models, self.groups)], BT)
        self.pages = [cpu_pages(seed + i) for i in range(len(self.groups))]
        self.worker = GroupTransfers([Transfers(mk(), p, async_link=mk()) for mk, p in zip(link, self.pages)],
                                     whole_requests=True)

    def client(self, g: int):
        return self.daemon.client(model=self.models[g], layout=self.groups[g].layout)

    def keys(self, req: str, g: int) -> list[bytes]:
        return self.planner._reqs[req].keys[g]

    def prefill(self, req: Req, block_ids: list[list[int]]) -> tuple[int, bool]:
        """One step of vLLM's for a new request: match, allocate, plan, run the loads and the stores."""
        n, asynchronous = self.planner.matched_tokens(req, 0)
        self.planner.allocated(req, block_ids, n)
        plan = self.planner.step(Step([NewReq(req.request_id, tuple(block_ids), n)], Cached(),
                                      {req.request_id: req.num_tokens - n}))
        self.worker.start_async([io for io in plan.loads if io.wait_s is not None])
        self.worker.load([io for io in plan.loads if io.wait_s is None])
        self.worker.store(plan.stores)
        return n, asynchronous

    def done(self, timeout: float = 30.0) -> tuple[set[str], set[str]]:
        deadline = time.monotonic() + timeout
        done: set[str] = set()
        while not done and time.monotonic() < deadline:
            done = self.worker.take_done()
            time.sleep(0.01)
        return done, self.worker.take_failed()


TOKENS = list(range(4000, 4000 + 6 * BT + 5))  # 6 full blocks and a partial one
SRC_IDS = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]


def same(a: VllmPages, ai: int, b: VllmPages, bi: int) -> bool:
    return all(torch.equal(x[ai], y[bi]) for x, y in zip(a.caches, b.caches))


def test_a_hybrid_prefix_loads_every_full_block_and_only_the_windows_blocks(daemon):
    src = Model(daemon, seed=1)
    assert src.prefill(Req("a", TOKENS), SRC_IDS) == (0, False)
    assert src.worker.take_counters().new_blocks == 2 * 6  # every block of both groups
    dst = Model(daemon, seed=10)
    before = [c.clone() for c in dst.pages[0].caches]
    # vLLM gives the sliding group its null block outside the window of the first token to compute
    ids = [[NULL, NULL, NULL, NULL, 5, 6, 7], [1, 2, 3, 4, 8, 9, 10]]
    assert dst.prefill(Req("b", TOKENS), ids) == (6 * BT, True)  # always beside the step
    assert dst.done() == ({"b"}, set())
    for i in range(6):  # the full group: every block; the sliding group: blocks 4 and 5 only
        assert same(src.pages[1], SRC_IDS[1][i], dst.pages[1], ids[1][i])
    for i in (4, 5):
        assert same(src.pages[0], SRC_IDS[0][i], dst.pages[0], ids[0][i])
    assert all(torch.equal(b[NULL], c[NULL]) for b, c in zip(before, dst.pages[0].caches))  # never written
    c = dst.worker.take_counters()
    assert c.hit_tokens == 6 * BT and c.async_loads == 1 and c.load_errors == 0
    assert c.load_bytes == (6 + 2) * LAYOUT.block_bytes and c.window_saved_bytes == 4 * LAYOUT.block_bytes


def test_a_position_one_group_lacks_is_a_miss_and_a_lost_block_fails_the_request(daemon):
    src = Model(daemon, seed=2)
    src.prefill(Req("a", TOKENS), SRC_IDS)
    with src.client(1) as c:  # the full group loses block 3 (evicted): 0 .. 2 remain
        assert c.delete(src.keys("a", 1)[3:4]) == 1
    dst = Model(daemon, seed=11)
    assert dst.planner.matched_tokens(Req("b", TOKENS), 0) == (3 * BT, True)
    with src.client(0) as c:  # the window of a hit at 3 reads block 1: gone too
        assert c.delete(src.keys("a", 0)[1:2]) == 1
    assert dst.planner.matched_tokens(Req("c", TOKENS), 0) == (BT, True)  # only a hit at 1 is whole
    # a block that vanishes between lookup and load fails the whole request: vLLM recomputes it
    n, _ = dst.planner.matched_tokens(Req("d", TOKENS), 0)
    dst.planner.allocated(Req("d", TOKENS), [[5, 6], [7, 8]], n)
    loads = dst.planner.step(Step([], Cached(), {})).loads
    with src.client(1) as c:
        assert c.delete(src.keys("a", 1)[0:1]) == 1
    dst.worker.start_async(loads)
    assert dst.done() == ({"d"}, {"d"})
    assert dst.worker.take_counters().load_errors > 0 and not dst.worker.take_load_errors()


def test_one_groups_blocks_are_never_served_as_anothers(daemon):
    """Two groups of one layout store different K/V under the same tokens; each loads back its own."""
    src = Model(daemon, seed=3)
    src.prefill(Req("a", TOKENS), SRC_IDS)
    assert not any(same(src.pages[0], SRC_IDS[0][i], src.pages[1], SRC_IDS[1][i]) for i in range(6))
    with src.client(0) as c:  # the sliding group's namespace has none of the full group's keys
        assert c.lookup(src.keys("a", 1)) == 0 and c.lookup(src.keys("a", 0)) == 6
    dst = Model(daemon, seed=12)
    ids = [[NULL, NULL, NULL, NULL, 5, 6, 7], [1, 2, 3, 4, 8, 9, 10]]
    dst.prefill(Req("b", TOKENS), ids)
    assert dst.done() == ({"b"}, set())
    for i in (4, 5):
        assert same(src.pages[0], SRC_IDS[0][i], dst.pages[0], ids[0][i])
        assert not same(src.pages[1], SRC_IDS[1][i], dst.pages[0], ids[0][i])
        assert same(src.pages[1], SRC_IDS[1][i], dst.pages[1], ids[1][i])
    # the same model with its groups in the other order (another grouping by vLLM) finds nothing
    swapped = gemma_like()[::-1]
    other = Model(daemon, seed=13, groups=[GroupSpec(i, g.kind, g.layout, g.layer_names, g.window, g.reach)
                                            for i, g in enumerate(swapped)])
    assert other.planner.matched_tokens(Req("c", TOKENS), 0) == (0, False)


def test_a_store_is_kept_for_every_group_or_for_none(daemon):
    src = Model(daemon, seed=4)
    full = src.worker.parts[1]

    def no_room(stores):
        full.counters.store_skipped += sum(len(io.keys) for io in stores)
        return None

    full.stage = no_room  # the full group finds no slot: the sliding group's staged blocks go back too
    src.prefill(Req("a", TOKENS), SRC_IDS)
    c = src.worker.take_counters()
    assert c.new_blocks == 0 and c.store_skipped == 2 * 6
    with src.client(0) as client:
        assert client.lookup(src.keys("a", 0)) == 0
        assert client.stats()["tiers"]["host"]["blocks"] == 0


def test_a_sliding_window_model_loads_only_its_window(daemon):
    """One sliding-window group (Mistral-style): after a restart of vLLM only the window's blocks move."""
    (sw,), _ = group_specs(config(spec("sliding")))
    src = Model(daemon, seed=5, groups=[sw], model="mistral")
    src.prefill(Req("a", TOKENS), SRC_IDS[:1])
    dst = Model(daemon, seed=14, groups=[sw], model="mistral")
    ids = [[NULL, NULL, NULL, NULL, 5, 6, 7]]
    assert dst.prefill(Req("b", TOKENS), ids) == (6 * BT, True)
    assert dst.done() == ({"b"}, set())
    assert same(src.pages[0], 5, dst.pages[0], 5) and same(src.pages[0], 6, dst.pages[0], 6)
    c = dst.worker.take_counters()
    assert c.hit_tokens == 6 * BT and c.load_bytes == 2 * LAYOUT.block_bytes
    assert c.window_saved_bytes == 4 * LAYOUT.block_bytes


def test_latent_pages_copy_bit_exactly():
    """MLA pages ([blocks, tokens, latent] or with a head axis of one) to tierkv blocks and back."""
    g = torch.Generator().manual_seed(6)
    caches = [torch.randn(8, BT, 576, generator=g).to(torch.bfloat16) for _ in range(2)]
    p = VllmPages(caches, 576, kind="latent")
    assert p.layout == Layout(2, 1, 576, BT, "bfloat16", kind="latent")
    out = [torch.empty(p.layout.block_shape, dtype=torch.bfloat16) for _ in range(2)]
    p.gather([3, 5], out)
    assert torch.equal(out[0][0, 1, 0], caches[1][3]) and torch.equal(out[1][0, 0, 0], caches[0][5])
    fresh = [torch.zeros(8, 1, BT, 576, dtype=torch.bfloat16) for _ in range(2)]
    VllmPages(fresh, 576, kind="latent").scatter(out, [6, 1])
    assert torch.equal(fresh[0][6, 0], caches[0][3]) and torch.equal(fresh[1][1, 0], caches[1][5])
    with pytest.raises(ValueError, match="1 \\* head_dim"):
        VllmPages(caches, 512, kind="latent")
    fp8 = VllmPages([torch.zeros(4, HEADS, BT, 2 * DIM, dtype=torch.uint8)], DIM, dtype="float8_e4m3fn")
    assert fp8.layout.dtype == "float8_e4m3fn"
    with pytest.raises(ValueError, match="does not fit"):
        VllmPages([torch.zeros(4, HEADS, BT, 2 * DIM)], DIM, dtype="float8_e4m3fn")


def test_fp8_pages_are_kept_byte_for_byte_and_named_by_their_format(daemon_factory):
    """An fp8 KV cache (vLLM types its pages uint8): stored as the pages hold it, through the disk tier of a
    daemon whose codec quantizes floats (it leaves fp8 alone), and never found under the other fp8 format."""
    d = daemon_factory(["--codec", "fp8"])
    pages_spec = kvi.FullAttentionSpec(block_size=BT, num_kv_heads=HEADS, head_size=DIM, dtype=torch.uint8)
    (e4m3,), _ = group_specs(config(pages_spec), cache_dtype="fp8")
    (e5m2,), _ = group_specs(config(pages_spec), cache_dtype="fp8_e5m2")
    g = torch.Generator().manual_seed(7)
    src = VllmPages([torch.randint(0, 256, (8, HEADS, BT, 2 * DIM), dtype=torch.uint8, generator=g)
                     for _ in range(2)], DIM, dtype=e4m3.layout.dtype)
    tokens = list(range(300, 300 + 3 * BT + 1))
    ns = Namespace("fp8-model", e4m3.layout)
    planner = Planner.single(Link(d.socket, model="fp8-model", layout=e4m3.layout), ns, BT)
    planner.matched_tokens(Req("a", tokens), 0)
    planner.allocated(Req("a", tokens), [[1, 2, 3, 4]], 0)
    stores = planner.step(Step([NewReq("a", ([1, 2, 3, 4],), 0)], Cached(), {"a": len(tokens)})).stores
    Transfers(Link(d.socket, model="fp8-model", layout=e4m3.layout), src).store(stores)
    d.stop()
    d.start()  # the blocks come back from disk
    with d.client(model="fp8-model", layout=e5m2.layout) as c:
        assert c.lookup(c.block_keys(tokens)) == 0
    dst = VllmPages([torch.zeros(8, HEADS, BT, 2 * DIM, dtype=torch.uint8) for _ in range(2)], DIM,
                    dtype=e4m3.layout.dtype)
    fresh = Planner.single(Link(d.socket, model="fp8-model", layout=e4m3.layout), ns, BT)
    assert fresh.matched_tokens(Req("b", tokens), 0) == (3 * BT, True)  # on disk: loaded beside the step
    fresh.allocated(Req("b", tokens), [[5, 6, 7, 0]], 3 * BT)
    t = Transfers(Link(d.socket, model="fp8-model", layout=e4m3.layout), dst)
    t.load(fresh.step(Step([], Cached(), {})).loads)
    assert not t.take_load_errors()
    assert all(torch.equal(s[b], x[b + 4]) for s, x in zip(src.caches, dst.caches) for b in (1, 2, 3))
    with d.client(model="fp8-model", layout=e4m3.layout) as c:
        assert c.stats()["tiers"]["disk"]["codec"] == "fp8"

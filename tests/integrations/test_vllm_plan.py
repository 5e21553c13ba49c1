"""The vLLM connector's plain parts against a real daemon, without vLLM: the scheduler-side planner,
the worker-side transfers over CPU pages in vLLM's layout, the reconnecting link, and what an engine
process imports."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from tests import redis_servers
from tests.helpers import REPO
from tests.redis_servers import need_redis
from tierkv.core.keys import Namespace, chain_keys
from tierkv.core.layout import Layout
from tierkv.integrations.vllm.inputs import salt_root
from tierkv.integrations.vllm.link import Link
from tierkv.integrations.vllm.pages import VllmPages
from tierkv.integrations.vllm.plan import PlanGroup, Planner
from tierkv.integrations.vllm.role import Role
from tierkv.integrations.vllm.transfer import Transfers

redis_server = redis_servers.redis_server

# vLLM's CPU pages for a small model: 2 layers, 2 KV heads of 32, 32-token blocks.
LAYOUT = Layout(num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=32, dtype="float32")
BT = LAYOUT.block_tokens


@dataclass
class Req:
    """The attributes of a vLLM request the planner reads."""

    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    num_output_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass
class NewReq:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class Cached:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class Step:
    scheduled_new_reqs: list[NewReq]
    scheduled_cached_reqs: Cached
    num_scheduled_tokens: dict[str, int]


def pages(num_blocks: int = 16, seed: int = 0) -> VllmPages:
    g = torch.Generator().manual_seed(seed)
    caches = [torch.randn(num_blocks, 2, BT, 64, generator=g) for _ in range(2)]
    return VllmPages(caches, 32)


def link(daemon) -> Link:
    return Link(daemon.socket, model="vllm-plan", layout=LAYOUT)


def prefill(planner: Planner, req: Req, block_ids: list[int], computed: int = 0):
    n, asynchronous = planner.matched_tokens(req, computed)
    assert not asynchronous  # these prefixes are in host memory: loaded inside the step
    planner.allocated(req, (block_ids,), n)
    step = Step([NewReq(req.request_id, (block_ids,), computed + n)], Cached(),
                {req.request_id: req.num_tokens - computed - n})
    return n, planner.step(step)


def test_a_prefill_stores_full_blocks_and_a_second_request_loads_them_identically(daemon):
    ns = Namespace("vllm-plan", LAYOUT)
    src, dst = pages(seed=1), pages(seed=2)
    tokens = list(range(1000, 1000 + 3 * BT + 5))  # 3 full blocks and a partial one
    planner = Planner.single(link(daemon), ns, BT)
    n, plan = prefill(planner, Req("a", tokens), [4, 9, 2, 7])
    assert n == 0 and not plan.loads
    assert [io.block_ids for io in plan.stores] == [[4, 9, 2]]
    assert plan.stores[0].keys == chain_keys(ns.fingerprint, tokens, BT)[:3]
    Transfers(link(daemon), src).store(plan.stores)

    n, plan = prefill(planner, Req("b", tokens), [1, 3, 5, 6])
    assert n == 3 * BT and [io.block_ids for io in plan.loads] == [[1, 3, 5]] and not plan.stores
    t = Transfers(link(daemon), dst)
    t.load(plan.loads)
    assert not t.take_load_errors()
    for a, b in ((4, 1), (9, 3), (2, 5)):
        assert all(torch.equal(s[a], d[b]) for s, d in zip(src.caches, dst.caches))
    c = t.take_counters()
    assert c.hit_tokens == 3 * BT and c.load_steps == 1 and 0 < c.load_max_s <= c.load_s


def test_roles_a_consumer_only_loads_and_a_producer_stores_its_whole_prompt(daemon):
    """PD through tierkv: the producer (prefill) stores every full block of the prompt, its own
    prefix hits included, committed within the step; the consumer (decode) loads it and stores nothing."""
    assert Role.of(None) == Role.of("kv_both") == Role(stores=True, commit_in_step=False, write_through=False)
    assert Role.of("kv_producer").commit_in_step and not Role.of("kv_consumer").stores
    assert [Role.of(r).write_through for r in ("kv_both", "kv_producer", "kv_consumer")] == [False, True, False]
    with pytest.raises(ValueError, match="kv_role"):
        Role.of("kv_relay")
    ns = Namespace("vllm-plan", LAYOUT)
    tokens = list(range(7000, 7000 + 3 * BT + 1))
    producer = Planner.single(link(daemon), ns, BT, stores=Role.of("kv_producer").stores)
    # vLLM's own prefix cache holds the first block: the producer stores it too
    n, plan = prefill(producer, Req("p", tokens), [3, 4, 5, 6], computed=BT)
    assert n == 0 and [io.block_ids for io in plan.stores] == [[3, 4, 5]]
    Transfers(link(daemon), pages(seed=3)).store(plan.stores)  # no committer: committed on return
    consumer = Planner.single(link(daemon), ns, BT, stores=Role.of("kv_consumer").stores)
    assert consumer.matched_tokens(Req("c", tokens), 0) == (3 * BT, False)
    n, plan = prefill(consumer, Req("c2", tokens + list(range(2 * BT))), [0, 1, 2, 7, 8, 9])
    assert n == 3 * BT and plan.loads and not plan.stores  # 5 full blocks, 2 new: none stored
    connector = pytest.importorskip("tierkv.integrations.vllm.connector")
    assert connector.TierKVConnector.requires_kv_delivery.fget(None) is False  # best effort in every role


def test_the_connector_reports_vllms_role():
    """vLLM's base class keeps the connector's KVConnectorRole (scheduler or worker side), read through
    ``role``; the tierkv role that ``kv_role`` names is kept apart from it."""
    connector = pytest.importorskip("tierkv.integrations.vllm.connector")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    ktc = SimpleNamespace(kv_load_failure_policy="recompute", kv_connector_extra_config={}, kv_role="kv_producer")
    cfg = SimpleNamespace(kv_transfer_config=ktc, parallel_config=SimpleNamespace(tensor_parallel_size=1),
                          model_config=SimpleNamespace(model="m"), cache_config=SimpleNamespace(cache_dtype="auto"))
    for role in KVConnectorRole:
        # no KV cache group: the connector is disabled and connects to no daemon
        c = connector.TierKVConnector(cfg, role, SimpleNamespace(kv_cache_groups=[]))
        assert c.role is role


@need_redis
def test_pd_across_nodes_the_consumer_finds_the_whole_prompt_when_the_producer_returns(daemon_factory,
                                                                                       redis_server):
    """The producer's daemon A and the consumer's daemon B share a Redis whose admission (``reused``)
    writes no fresh block through: the producer's in-step commit writes its prompt through and returns
    after, so the consumer's lookup right after finds all of it there and loads it bit-exact."""
    args = ["--remote", redis_server.url, "--remote-admission", "reused"]
    a, b = daemon_factory(args), daemon_factory(args)
    ns = Namespace("vllm-plan", LAYOUT)
    tokens = list(range(9000, 9000 + 3 * BT + 1))
    producer = Planner.single(link(a), ns, BT, stores=Role.of("kv_producer").stores)
    n, plan = prefill(producer, Req("p", tokens), [3, 4, 5, 6])
    src = pages(seed=6)
    Transfers(link(a), src, remote=Role.of("kv_producer").write_through).store(plan.stores)
    consumer = Planner.single(link(b), ns, BT, stores=Role.of("kv_consumer").stores)
    req = Req("c", tokens)
    assert consumer.matched_tokens(req, 0) == (3 * BT, True)  # all of it, in the remote tier
    consumer.allocated(req, ([0, 1, 2, 7],), 3 * BT)
    loads = consumer.step(Step([NewReq("c", ([0, 1, 2, 7],), 3 * BT)], Cached(), {"c": 1})).loads
    dst = pages(seed=7)
    t = Transfers(link(b), dst)
    t.load(loads)
    assert not t.take_load_errors()
    for s_, d_ in ((3, 0), (4, 1), (5, 2)):
        assert all(torch.equal(s[s_], d[d_]) for s, d in zip(src.caches, dst.caches))
    # a plain (kv_both-style) in-step store under ``reused`` leaves a fresh prompt on A alone
    other = list(range(20000, 20000 + 2 * BT + 1))
    _, plan = prefill(producer, Req("p2", other), [8, 9, 10])
    Transfers(link(a), pages(seed=8)).store(plan.stores)
    assert consumer.matched_tokens(Req("c2", other), 0) == (0, False)


def test_at_least_one_token_is_left_to_compute_and_short_prompts_store_nothing(daemon):
    planner = Planner.single(link(daemon), Namespace("vllm-plan", LAYOUT), BT)
    tokens = list(range(2 * BT))
    _, plan = prefill(planner, Req("full", tokens), [0, 1])
    Transfers(link(daemon), pages()).store(plan.stores)
    # Two cached blocks, but the prompt is exactly two blocks: the last token must be computed.
    assert planner.matched_tokens(Req("again", tokens), 0) == (BT, False)
    _, plan = prefill(planner, Req("short", list(range(BT - 1))), [3])
    assert not plan.stores and not plan.loads


def test_cache_salt_starts_another_chain(daemon):
    ns = Namespace("vllm-plan", LAYOUT)
    planner = Planner.single(link(daemon), ns, BT)
    tokens = list(range(500, 500 + 2 * BT + 1))
    _, plan = prefill(planner, Req("t1", tokens, cache_salt="alpha"), [0, 1, 2])
    Transfers(link(daemon), pages()).store(plan.stores)
    assert plan.stores[0].keys[0] == chain_keys(ns.fingerprint, tokens, BT, salt_root(ns.fingerprint, "alpha"))[0]
    assert planner.matched_tokens(Req("t2", tokens, cache_salt="alpha"), 0) == (2 * BT, False)
    assert planner.matched_tokens(Req("t3", tokens, cache_salt="beta"), 0) == (0, False)
    assert planner.matched_tokens(Req("t4", tokens), 0) == (0, False)


def test_decode_stores_each_block_as_it_fills_and_a_resumed_request_gets_new_block_ids(daemon):
    planner = Planner.single(link(daemon), Namespace("vllm-plan", LAYOUT), BT)
    req = Req("d", list(range(BT + 10)))
    _, plan = prefill(planner, req, [5, 6])
    assert [io.block_ids for io in plan.stores] == [[5]] and plan.stores[0].parent is None
    first = plan.stores[0].keys[0]
    req.all_token_ids.extend(range(BT - 10))  # decode fills block 2
    step = Step([], Cached(["d"], set(), [None], [2 * BT - 1]), {"d": 1})
    stores = planner.step(step).stores
    assert [io.block_ids for io in stores] == [[6]] and stores[0].parent == first  # it continues block 1
    req.all_token_ids.extend(range(BT))  # preempted, resumed on other blocks: nothing stored twice
    step = Step([], Cached(["d"], {"d"}, [([8, 9, 10],)], [3 * BT - 1]), {"d": 1})
    assert [io.block_ids for io in planner.step(step).stores] == [[10]]
    req.num_output_tokens = 2 * BT
    assert planner.finished(req) == chain_keys(Namespace("vllm-plan", LAYOUT).fingerprint, req.all_token_ids, BT)
    assert len(planner) == 0
    # the daemon is told how many tokens the request generated
    placement = link(daemon).call(lambda c: c.stats())["tiers"]["disk"]["placement"]
    assert placement["finished_with_output_tokens"] == 1


def test_missing_blocks_are_load_errors_never_wrong_data(daemon):
    ns = Namespace("vllm-plan", LAYOUT)
    planner = Planner.single(link(daemon), ns, BT)
    tokens = list(range(7000, 7000 + 3 * BT + 1))
    _, plan = prefill(planner, Req("m1", tokens), [0, 1, 2, 3])
    Transfers(link(daemon), pages()).store(plan.stores)
    n, plan = prefill(planner, Req("m2", tokens), [4, 5, 6, 7])
    assert n == 3 * BT
    with daemon.client(model="vllm-plan", layout=LAYOUT) as c:
        assert c.delete(plan.loads[0].keys[1:2]) == 1  # evicted between lookup and load
    dst = pages(seed=5)
    before = [c.clone() for c in dst.caches]
    t = Transfers(link(daemon), dst)
    t.load(plan.loads)
    assert t.take_load_errors() == {5, 6}
    assert all(torch.equal(b[5:7], c[5:7]) for b, c in zip(before, dst.caches))  # untouched


def test_without_a_daemon_everything_is_a_miss_and_the_link_comes_back(daemon_factory, tmp_path):
    d = daemon_factory(start=False)
    lk = Link(d.socket, model="vllm-plan", layout=LAYOUT)
    planner = Planner.single(lk, Namespace("vllm-plan", LAYOUT), BT)
    assert planner.matched_tokens(Req("x", list(range(3 * BT))), 0) == (0, False)
    t = Transfers(lk, pages())
    _, plan = prefill(planner, Req("y", list(range(2 * BT + 1))), [0, 1, 2])
    t.store(plan.stores)
    assert t.take_counters().store_errors == 2
    d.start()
    lk._next_try = 0.0  # skip the back-off pause
    _, plan = prefill(planner, Req("z", list(range(5, 5 + 2 * BT + 1))), [0, 1, 2])
    t.store(plan.stores)
    assert t.take_counters().stored_tokens == 2 * BT
    d.kill()
    d.start()  # the connection is broken: found at the next call and made again at once
    old = lk.get()
    assert planner.matched_tokens(Req("z2", list(range(5, 5 + 2 * BT + 1))), 0)[0] in (0, 2 * BT)
    assert lk.get() is not None and lk.get() is not old


def test_pages_refuse_bad_input():
    p = pages(num_blocks=4)
    out = [torch.empty(LAYOUT.block_shape)]
    with pytest.raises(ValueError, match="block ids"):
        p.gather([4], out)
    with pytest.raises(ValueError, match="repeat"):
        p.scatter(out * 2, [1, 1])
    with pytest.raises(ValueError, match="2 \\* head_dim"):
        VllmPages([torch.zeros(4, 2, BT, 60)], 32)


def test_the_engine_side_imports_neither_redis_nor_lmdb_nor_the_daemon():
    code = ("import sys, tierkv.client.client, tierkv.integrations.vllm.plan, tierkv.integrations.vllm.transfer; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('redis', 'lmdb', 'zstandard', 'vllm') "
            "or m.startswith(('tierkv.tiers', 'tierkv.daemon.server', 'tierkv.cache.table', 'tierkv.daemon.config'))); "
            "print(bad); sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("physical", ["HND", "NHD"])
def test_cuda_pages_round_trip_through_unpinned_host_blocks(physical):
    """CUDA caches, logically [blocks, heads, tokens, 2 * head_dim] in either physical order: gather into
    host blocks (as the client's slot views are) and scatter back, K and V where tierkv keeps them."""
    dev = torch.device("cuda")
    shape = (16, 2, BT, 64) if physical == "HND" else (16, BT, 2, 64)
    caches = [torch.randn(shape, device=dev) for _ in range(2)]
    if physical == "NHD":
        caches = [c.transpose(1, 2) for c in caches]  # logical [B, H, N, 2D] over physical [B, N, H, 2D]
    p = VllmPages(caches, 32)
    out = [torch.empty(LAYOUT.block_shape) for _ in range(3)]
    p.gather([3, 0, 9], out)
    p.synchronize()
    for i, b in enumerate([3, 0, 9]):
        for layer, c in enumerate(caches):
            assert torch.equal(out[i][0, layer], c[b, :, :, :32].cpu())
            assert torch.equal(out[i][1, layer], c[b, :, :, 32:].cpu())
    fresh = [torch.zeros_like(c) for c in caches]
    q = VllmPages(fresh, 32)
    q.scatter(out, [1, 2, 3])
    q.synchronize()
    for layer in range(2):
        assert torch.equal(fresh[layer][1], caches[layer][3]) and torch.equal(fresh[layer][3], caches[layer][9])


def test_the_vllm_demo_without_a_daemon_is_one_line(tmp_path):
    p = subprocess.run([sys.executable, str(REPO / "examples" / "demo.py"), "--socket", str(tmp_path / "none.sock")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert p.stderr.strip().count("\n") == 0 and "cannot reach tierkv" in p.stderr


def test_starting_a_running_vllm_server_again_starts_no_second_one(tmp_path):
    """``with VllmServer(...).start() as s`` calls ``start`` twice: the second call leaves the running
    server as it is (a second one would outlive ``stop``, holding its memory)."""
    from _vllm_server import VllmServer

    s = VllmServer("model", None, tmp_path / "log")
    s.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    running = s.proc
    assert s.start(wait=False) is s and s.proc is running
    s.stop(timeout=5)
    assert running.poll() is not None and s.proc is None


def test_the_sync_load_limit_is_read_from_the_extra_config_and_checked():
    connector = pytest.importorskip("tierkv.integrations.vllm.connector")
    assert connector._sync_load_blocks({}, 2**20) is None  # every prefix in host memory inside the step
    assert connector._sync_load_blocks({"sync_load_max_mib": 0.5}, 2**18) == 2
    for bad in (-1, "big", True, float("nan")):
        with pytest.raises(ValueError, match="sync_load_max_mib"):
            connector._sync_load_blocks({"sync_load_max_mib": bad}, 2**20)


def _adapter(root, seed: int, name: str = "ada"):
    """A PEFT adapter directory with random weights on k_proj/v_proj (a real adapter's files)."""
    import json

    from safetensors.torch import save_file

    d = root / name
    d.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    save_file({f"base_model.model.model.layers.0.self_attn.{m}.lora_{ab}.weight": torch.randn(8, 8, generator=g)
               for m in ("k_proj", "v_proj") for ab in "AB"}, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "peft_type": "LORA",
                                                      "target_modules": ["k_proj", "v_proj"],
                                                      "base_model_name_or_path": str(root / "base")}))
    return d


def _vllm_request(rid: str, tokens: list[int], **kw):
    """vLLM's own Request object, as its scheduler hands it to the connector."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, tokens, SamplingParams(max_tokens=1), None, **kw)


def test_adapters_images_and_prompt_embeddings_key_requests_apart(daemon, tmp_path):
    """A request through an adapter never loads the base model's blocks (or another adapter's), and
    shares with the same adapter under another name and path; an image or prompt embeddings key the
    blocks they reach; a request with an input that cannot be identified is neither loaded nor stored."""
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    from tierkv.integrations.vllm.inputs import AdapterIdentities, request_inputs

    ns = Namespace("vllm-plan", LAYOUT, identity="a" * 32)
    adapters = AdapterIdentities()
    planner = Planner([PlanGroup(Link(daemon.socket, model="vllm-plan", layout=LAYOUT, identity=ns.identity), ns)],
                      BT, identify=lambda r: request_inputs(r, BT, adapters))
    tokens = list(range(3000, 3000 + 3 * BT + 1))
    src = pages(seed=7)

    def stored(req) -> int:
        n, plan = prefill(planner, req, [1, 2, 3, 4])
        Transfers(Link(daemon.socket, model="vllm-plan", layout=LAYOUT, identity=ns.identity), src).store(plan.stores)
        return n

    lora = LoRARequest("ada", 1, str(_adapter(tmp_path / "a", seed=0)))
    same = LoRARequest("ada-copy", 2, str(_adapter(tmp_path / "b", seed=0, name="renamed")))
    other = LoRARequest("other", 3, str(_adapter(tmp_path / "c", seed=1)))
    assert stored(_vllm_request("base", tokens)) == 0
    assert planner.matched_tokens(_vllm_request("base-again", tokens), 0) == (3 * BT, False)
    assert planner.matched_tokens(_vllm_request("lora", tokens, lora_request=lora), 0) == (0, False)
    assert stored(_vllm_request("lora-store", tokens, lora_request=lora)) == 0
    assert planner.matched_tokens(_vllm_request("same", tokens, lora_request=same), 0) == (3 * BT, False)
    assert planner.matched_tokens(_vllm_request("other", tokens, lora_request=other), 0) == (0, False)

    def image(ident: str) -> MultiModalFeatureSpec:
        return MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                     mm_position=PlaceholderRange(offset=BT + 5, length=20))

    # the image sits in block 1: block 0 is the base model's, blocks 1 and 2 are keyed by the image
    assert planner.matched_tokens(_vllm_request("img-a", tokens, mm_features=[image("img-a")]), 0) == (BT, False)
    assert stored(_vllm_request("img-a-store", tokens, mm_features=[image("img-a")])) == BT
    assert planner.matched_tokens(_vllm_request("img-a2", tokens, mm_features=[image("img-a")]), 0) == (3 * BT, False)
    assert planner.matched_tokens(_vllm_request("img-b", tokens, mm_features=[image("img-b")]), 0) == (BT, False)

    # prompt embeddings: their token ids are all placeholders; the embeddings key every block
    g = torch.Generator().manual_seed(3)
    e1, e2 = torch.randn(3 * BT + 1, 16, generator=g), torch.randn(3 * BT + 1, 16, generator=g)
    assert stored(_vllm_request("e1", None, prompt_embeds=e1)) == 0
    assert planner.matched_tokens(_vllm_request("e1-again", None, prompt_embeds=e1.clone()), 0) == (3 * BT, False)
    assert planner.matched_tokens(_vllm_request("e2", None, prompt_embeds=e2), 0) == (0, False)

    # an adapter that cannot be read: neither loaded nor stored, counted once per request
    missing = LoRARequest("gone", 4, str(tmp_path / "no-such-adapter"))
    req = _vllm_request("gone", tokens, lora_request=missing)
    n, plan = prefill(planner, req, [1, 2, 3, 4])
    assert n == 0 and not plan.loads and not plan.stores and planner.queued(req) == 0
    assert planner.unidentified == 1


def test_the_store_gate_skips_a_stream_without_reuse_and_stores_again_once_it_repeats(daemon):
    """The scheduler side asks the daemon's store gate once per step: one-off prompts stop being stored
    within a bounded number of requests (nothing is copied or committed for them); a prompt that comes
    back is stored again, and then served."""
    ns = Namespace("vllm-gate", LAYOUT)
    planner = Planner([PlanGroup(Link(daemon.socket, model="vllm-gate", layout=LAYOUT), ns)], BT, gate=True)
    src = pages(seed=11)
    worker = Transfers(Link(daemon.socket, model="vllm-gate", layout=LAYOUT), src)
    stored = []
    for i in range(30):
        _n, plan = prefill(planner, Req(f"once-{i}", list(range(10_000 * (i + 1), 10_000 * (i + 1) + 3 * BT + 1))),
                           [1, 2, 3, 4])
        stored.append(sum(len(io.keys) for io in plan.stores))
        worker.store(plan.stores)
    assert stored[0] == 3 and stored[-10:] == [0] * 10
    assert planner.offers is not None and planner.offers.offered == 90 and planner.offers.gated == 90 - sum(stored)
    gate = daemon.stats()["store_gate"]
    assert gate["skipped"] == planner.offers.gated and gate["returns"] == 0
    again = list(range(900_000, 900_000 + 3 * BT + 1))
    assert [prefill(planner, Req(f"again-{i}", again), [1, 2, 3, 4])[0] for i in range(2)] == [0, 0]
    n, plan = prefill(planner, Req("again-2", again), [1, 2, 3, 4])
    # its second offer was a return: from then on it is stored
    assert n == 0 and sum(len(io.keys) for io in plan.stores) == 3
    worker.store(plan.stores)
    assert planner.matched_tokens(Req("again-3", again), 0) == (3 * BT, False)
    assert daemon.stats()["store_gate"]["returns"] >= 2


def test_an_idle_engine_stores_what_the_gate_skipped_until_the_stream_shows_no_reuse(daemon):
    """A request the gate cut stores its idle run when it ends with no other request left: the next step
    copies those blocks out of the pages vLLM kept for it and releases the request. The idle run ends too
    as the stream goes on without reuse; an engine with another request waiting or running stores none."""
    ns = Namespace("vllm-idle", LAYOUT)
    planner = Planner([PlanGroup(Link(daemon.socket, model="vllm-idle", layout=LAYOUT), ns)], BT, gate=True)
    worker = Transfers(Link(daemon.socket, model="vllm-idle", layout=LAYOUT), pages(seed=12))

    def stream(salt: str, busy: bool) -> tuple[list[int], list[int]]:
        in_step, idle = [], []
        if busy:  # a request that waits all along
            planner.matched_tokens(Req(f"{salt}-waiting", list(range(5, 5 + 2 * BT)), cache_salt=salt), 0)
        for i in range(30):
            base = 10_000 * (i + 1) + (500_000 if busy else 0)
            req = Req(f"{salt}-{i}", list(range(base, base + 3 * BT + 1)), cache_salt=salt)
            _n, plan = prefill(planner, req, [1, 2, 3, 4])
            in_step.append(sum(len(io.keys) for io in plan.stores))
            worker.store(plan.stores)
            planner.finished(req)
            held = planner.holds(req.request_id)
            after = planner.step(Step([], Cached(), {}))
            assert after.release == ([req.request_id] if held else []) and held == bool(after.stores)
            assert all(io.block_ids == [1, 2, 3][io.first:] for io in after.stores)
            idle.append(sum(len(io.keys) for io in after.stores))
            worker.store(after.stores)
        return in_step, idle

    in_step, idle = stream("quiet", busy=False)
    stored = [a + b for a, b in zip(in_step, idle)]
    k = stored.index(0) if 0 in stored else len(stored)
    assert in_step[0] == 3 and 0 in in_step and sum(idle) > 0
    assert all(n > 0 for n in stored[:k]) and stored[-10:] == [0] * 10, stored
    assert planner.idle.stored == sum(idle)
    last = max(i for i, n in enumerate(idle) if n)  # the last request an idle engine stored: served whole
    tokens = list(range(10_000 * (last + 1), 10_000 * (last + 1) + 3 * BT + 1))
    assert planner.matched_tokens(Req("again", tokens, cache_salt="quiet"), 0) == (stored[last] * BT, False)
    assert daemon.stats()["store_gate"]["idle"] >= sum(idle)

    in_step, idle = stream("busy", busy=True)  # vLLM's KV cache usage unknown: nothing is held
    assert in_step[0] == 3 and 0 in in_step and idle == [0] * 30


def test_a_request_ending_beside_others_is_held_for_the_first_idle_step_while_vllm_has_room(daemon):
    """Runs of requests that end while another runs wait, their pages held by vLLM, for the first step
    with no request left, while vLLM's KV cache is at most half full; over three quarters full the held
    pages are given back unstored, oldest first."""
    ns = Namespace("vllm-held", LAYOUT)
    planner = Planner([PlanGroup(Link(daemon.socket, model="vllm-held", layout=LAYOUT), ns)], BT, gate=True)
    worker = Transfers(Link(daemon.socket, model="vllm-held", layout=LAYOUT), pages(seed=13))
    usage = [0.2]
    planner.idle.usage = lambda: usage[0]
    other = Req("other", list(range(5, 5 + 2 * BT)))
    planner.matched_tokens(other, 0)  # waits all along
    held = []
    for i in range(12):
        req = Req(f"h-{i}", list(range(10_000 * (i + 1), 10_000 * (i + 1) + 3 * BT + 1)))
        _n, plan = prefill(planner, req, [1, 2, 3, 4])
        worker.store(plan.stores)
        planner.finished(req)
        if planner.holds(req.request_id):
            held.append(req.request_id)
        after = planner.step(Step([], Cached(), {}))
        assert not after.stores and not after.release  # another request is live: nothing is copied
    assert held and planner.idle.stored == 0
    usage[0] = 0.8  # vLLM needs its room: the oldest held pages go back, unstored
    after = planner.step(Step([], Cached(), {}))
    assert not after.stores and after.release == held and planner.idle.given_up > 0
    usage[0] = 0.2
    held = []
    for i in range(12, 14):  # two more ended beside the waiting one, then it ends too: the next step stores all
        req = Req(f"h-{i}", list(range(10_000 * (i + 1), 10_000 * (i + 1) + 3 * BT + 1)))
        worker.store(prefill(planner, req, [5, 6, 7, 8])[1].stores)
        planner.finished(req)
        assert planner.holds(req.request_id)
        held.append(req.request_id)
    planner.finished(other)
    after = planner.step(Step([], Cached(), {}))
    assert after.release == held and sum(len(io.keys) for io in after.stores) == planner.idle.stored > 0
    worker.store(after.stores)

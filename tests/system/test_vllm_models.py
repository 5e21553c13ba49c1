"""Models beyond one full-attention group, through vLLM's real CPU build and a real daemon: Gemma-3 text
(sliding-window and full-attention layers interleaved: two KV cache groups), Mistral with a sliding
window on every layer, and DeepSeek-V2-style MLA (a 512 + 64 latent per token). The models are small,
random-weight, made by the tests (``tests/tiny_models.py``, ``tools/_random_models.py``).

For each model one vLLM server with tierkv runs (a start costs most of a minute): it answers the prompt
under a ``cache_salt`` of its own twice, as vLLM alone does (nothing of tierkv's is served to that chain:
cold, then from vLLM's own prefix cache); then without the salt, and stores it; then, its own prefix
cache emptied (``VLLM_SERVER_DEV_MODE``), again, from tierkv. The tests then compare what each saw.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from _vllm_server import VllmServer

import tierkv
from tests import tiny_models
from tests.helpers import Daemon

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.timeout(2400)]

DTYPE = {"gemma3": "float32", "mistral": "float32", "deepseek": "bfloat16"}  # vLLM's CPU MoE takes no float32
BT = 128  # vLLM's block size on the CPU, for these models too
PROMPT = list(range(1000, 1000 + 900))  # 7 full blocks and a partial one
HIT = (len(PROMPT) - 1) // BT * BT  # 896: every full block (one token is always computed)


@dataclass
class Run:
    """What one model's three servers answered."""

    model_dir: Path
    socket: str
    alone: list[dict[str, Any]] = field(default_factory=list)  # vLLM alone: cold, then its own cache
    stored: dict[str, Any] = field(default_factory=dict)       # vLLM + tierkv, first start
    loaded: dict[str, Any] = field(default_factory=dict)       # vLLM + tierkv, restarted
    metrics: dict[str, float] = field(default_factory=dict)    # the restarted server's tierkv counters
    namespaces: dict[str, dict] = field(default_factory=dict)  # the daemon's, by model id
    vllm_prefix_cache: bool = True  # False: vLLM's CPU build turned its prefix cache off (MLA without AMX)


def _counters(server: VllmServer) -> dict[str, float]:
    """The connector's counters on vLLM's /metrics (they reach it with vLLM's periodic stats)."""
    names = ("hit_tokens", "load_bytes", "window_saved_bytes", "load_errors")
    deadline = time.monotonic() + 30
    while server.metric("vllm:tierkv_hit_tokens_total") < HIT and time.monotonic() < deadline:
        server.complete([1, 2, 3], max_tokens=1)
        time.sleep(0.5)
    return {n: server.metric(f"vllm:tierkv_{n}_total") for n in names}


def _run(arch: str, work: Path, daemon: Daemon) -> Run:
    run = Run(tiny_models.make(arch, work / "models"), daemon.socket)

    log = work / f"vllm-{arch}.log"
    with VllmServer(str(run.model_dir), daemon.socket, log, dtype=DTYPE[arch], env={"VLLM_SERVER_DEV_MODE": "1"},
                    one_process=True) as s:
        run.alone = [s.complete(PROMPT, salt="alone"), s.complete(PROMPT, salt="alone")]
        run.vllm_prefix_cache = "prefix caching to be disabled" not in log.read_text()
        run.stored = s.complete(PROMPT)
        _flushed(daemon, run.model_dir.name)
        s.reset_prefix_cache()  # vLLM's own cache is empty: the prompt is in tierkv only
        run.loaded = s.complete(PROMPT)
        run.metrics = _counters(s)
        run.namespaces = {ns["model"]: ns for ns in daemon.stats()["namespaces"].values()
                          if ns["model"].startswith(run.model_dir.name + "#")}
    return run


def _flushed(daemon: Daemon, model: str) -> None:
    """Wait until both chains of the prompt (the salted reference's and the plain one) are committed in
    every group's namespace (the connector commits behind the step), or 30 s."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        spaces = [ns for ns in daemon.stats()["namespaces"].values() if ns["model"].startswith(model + "#")]
        if spaces and all(ns["blocks"] >= 2 * ((len(PROMPT) - 1) // ns["layout"]["block_tokens"]) for ns in spaces):
            return
        time.sleep(0.1)


def _hit(run: Run) -> int:
    """Tokens of the prompt's full blocks at the block size vLLM chose (16 for MLA without AMX, else 128)."""
    bt = min(ns["layout"]["block_tokens"] for ns in run.namespaces.values())
    return (len(PROMPT) - 1) // bt * bt


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Daemon:
    d = Daemon(tmp_path_factory.mktemp("daemon"), ["--host-capacity", "512MiB", "--slab-bytes", "32MiB"])
    d.workdir.mkdir(parents=True, exist_ok=True)
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, daemon) -> dict[str, Run]:
    work = tmp_path_factory.mktemp("models")
    return {arch: _run(arch, work, daemon) for arch in DTYPE}


@pytest.mark.parametrize("arch", list(DTYPE))
def test_from_tierkv_alone_the_prompt_is_served_and_vllm_answers_as_alone(runs, arch):
    """The answer served from tierkv equals vLLM alone's from its own prefix cache, token for token and
    log-probability for log-probability; with float32 it equals the cold answer too. (vLLM's MLA computes a
    prompt with a cached prefix on another path than a whole prompt: in bfloat16 the two differ.)"""
    run = runs[arch]
    cold, warm = run.alone
    hit = _hit(run)
    assert run.stored["cached_tokens"] == 0
    assert run.loaded["cached_tokens"] == hit  # vLLM's own cache was emptied: all from tierkv
    assert run.metrics["hit_tokens"] >= hit and run.metrics["load_errors"] == 0
    if not run.vllm_prefix_cache:
        pytest.skip("vLLM's CPU build runs MLA without AMX with its prefix cache off: no answer of vLLM alone "
                    "from a cached prefix to compare with (tierkv's load is checked above)")
    assert warm["cached_tokens"] == hit
    assert run.loaded["tokens"] == warm["tokens"]
    assert run.loaded["logprobs"] == pytest.approx(warm["logprobs"], abs=1e-3)
    if DTYPE[arch] == "float32":
        assert run.loaded["tokens"] == cold["tokens"] == run.stored["tokens"]


@pytest.mark.parametrize("arch", list(DTYPE))
def test_each_group_stores_the_prompts_pages_with_its_own_layers(runs, arch):
    """Each KV cache group's namespace holds one block per full block of the prompt (the pages vLLM filled;
    twice: under the reference's salt too),
    with the keys and values of that group's layers: what transformers computes for them. Gemma's two
    groups share a layout and the tokens: only their own layers' K/V are found in each."""
    run = runs[arch]
    kinds = tiny_models.layer_groups(arch, run.model_dir)
    assert sorted(m.split("#")[1].split(".")[1].rstrip("0123456789") for m in run.namespaces) == sorted(kinds)
    reference = tiny_models.reference_kv(run.model_dir, PROMPT)
    for model, ns in run.namespaces.items():
        layout = tierkv.Layout.from_dict(ns["layout"])
        hit = (len(PROMPT) - 1) // layout.block_tokens * layout.block_tokens
        assert ns["blocks"] == 2 * (hit // layout.block_tokens)  # the prompt's chain and the salted reference's
        with tierkv.Client.connect(run.socket, model=model, layout=layout, identity=ns["identity"]) as c:
            blocks = c.get(c.block_keys(PROMPT)).float()  # [blocks, planes, layers, heads, tokens, dim]
        layers = kinds[model.split("#")[1].split(".")[1].rstrip("0123456789")]
        assert layout.num_layers == len(layers)
        for j, layer in enumerate(layers):
            got = blocks[:, :, j].permute(1, 2, 0, 3, 4).reshape(layout.planes, layout.num_kv_heads, hit, -1)
            want = reference[layer][:, :, :hit]
            if layout.kind == "kv":
                assert torch.allclose(got, want, atol=1e-4), (model, layer)
            elif layer == 0:  # MLA: the latent (bfloat16) of the first layer; its rope part at position 0
                assert torch.allclose(got[..., :512], want[..., :512], atol=0.05, rtol=0.02)
                assert torch.allclose(got[..., 0, 512:], want[..., 0, 512:], atol=0.05, rtol=0.02)


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_a_sliding_window_loads_only_the_blocks_its_window_reads(runs, arch):
    """A hit of 7 blocks: the window (256 tokens, 255 back from the first token to compute) reads the
    last two; the five before are served without being moved, counted in ``window_saved_bytes``."""
    run = runs[arch]
    sliding = next(tierkv.Layout.from_dict(ns["layout"]) for m, ns in run.namespaces.items() if ".sliding" in m)
    full = [tierkv.Layout.from_dict(ns["layout"]) for m, ns in run.namespaces.items() if ".full" in m]
    blocks = HIT // BT
    inside = blocks - (HIT - (tiny_models.WINDOW - 1)) // BT
    assert run.metrics["window_saved_bytes"] == (blocks - inside) * sliding.block_bytes > 0
    assert run.metrics["load_bytes"] == inside * sliding.block_bytes + sum(blocks * lo.block_bytes for lo in full)

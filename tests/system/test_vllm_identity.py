"""Cache identity through vLLM's real CPU build: KV is served only to the weights, adapter and inputs that
computed it.

One daemon serves three vLLM servers in turn, each of a small random-weight Llama made by the test:

* ``a/tiny-llama`` (with a LoRA adapter the test makes, random weights on k_proj and v_proj, and prompt
  embeddings enabled): a request through the adapter never loads the base model's blocks and the other
  way round, each answering as it does alone; two prompt embeddings of one length never share a block;
* ``b/tiny-llama``: other weights in a directory of the same name: it is served nothing the first one
  stored and answers as it does alone;
* ``c/renamed``: a copy of the first one's weights in another directory: it is served every block the
  first one stored.

"As it does alone" is the same request under a ``cache_salt`` of its own, whose chain nothing else
stored: what the model computes with nothing served. Greedy replies are compared token for token.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from _vllm_server import VllmServer

from tests import tiny_models
from tests.helpers import Daemon

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.timeout(1800)]

BT = 128
PROMPT = list(range(2000, 2000 + 5 * BT + 40))  # five full blocks and a partial one
HIT = 5 * BT
DEV = {"VLLM_SERVER_DEV_MODE": "1"}


def _adapter(model_dir: Path, out: Path, seed: int = 7, r: int = 8) -> Path:
    """A PEFT LoRA adapter for the tiny Llama: random (nonzero) A and B on every layer's k_proj and v_proj."""
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, kv = cfg["hidden_size"], cfg["num_key_value_heads"] * cfg["head_dim"]
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for m in ("k_proj", "v_proj"):
            pre = f"base_model.model.model.layers.{i}.self_attn.{m}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(r, hidden, generator=g) * 0.5
            tensors[f"{pre}.lora_B.weight"] = torch.randn(kv, r, generator=g) * 0.5
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "lora_dropout": 0.0, "bias": "none",
        "target_modules": ["k_proj", "v_proj"], "base_model_name_or_path": str(model_dir),
        "task_type": "CAUSAL_LM"}))
    return out


def _embeds(seed: int) -> str:
    """Prompt embeddings (five full blocks and a partial one of the tiny model's width), as vLLM takes them."""
    t = torch.randn(len(PROMPT), 128, generator=torch.Generator().manual_seed(seed)) * 0.05
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


class Fleet:
    """The daemon, the three model directories and the adapter; one server at a time."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.a = tiny_models.make("llama", work / "a", seed=0)
        self.b = tiny_models.make("llama", work / "b", seed=1)
        assert self.a.name == self.b.name  # the same directory name: the same model id
        self.c = work / "c" / "renamed"
        shutil.copytree(self.a, self.c)
        self.adapter = _adapter(self.a, work / "adapter")
        self.daemon = Daemon(work / "daemon", ["--host-capacity", "256MiB", "--slab-bytes", "8MiB"])
        self.daemon.workdir.mkdir(parents=True, exist_ok=True)
        self.daemon.start()

    def server(self, model_dir: Path, name: str, args: list[str] | None = None) -> VllmServer:
        return VllmServer(str(model_dir), self.daemon.socket, self.work / f"vllm-{name}.log", env=DEV,
                          args=list(args or []), one_process=True).start()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Fleet:
    f = Fleet(tmp_path_factory.mktemp("identity"))
    yield f
    f.daemon.stop()


@pytest.fixture(scope="module")
def first(fleet):
    """The first model's server, with the adapter and prompt embeddings; it stores PROMPT as the base model."""
    s = fleet.server(fleet.a, "a", ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1",
                                    "--lora-modules", f"ada={fleet.adapter}", "--enable-prompt-embeds"])
    s.answers = {"base": s.complete(PROMPT)}  # type: ignore[attr-defined]
    yield s
    s.stop()


def test_an_adapter_never_loads_the_base_models_blocks_and_answers_as_alone(first):
    base = first.answers["base"]
    assert base["cached_tokens"] == 0
    alone = first.complete(PROMPT, model="ada", salt="ada-alone")
    assert alone["cached_tokens"] == 0
    through = first.complete(PROMPT, model="ada")
    assert through["cached_tokens"] == 0  # the base model's blocks are there, under another identity
    assert through["tokens"] == alone["tokens"]
    assert alone["logprobs"] != base["logprobs"]  # the adapter changes K and V (and so the answer)
    first.reset_prefix_cache()  # vLLM's own cache is empty: only tierkv holds the adapter's blocks
    again = first.complete(PROMPT, model="ada")
    assert again["cached_tokens"] == HIT and again["tokens"] == alone["tokens"]  # its own blocks: shared


def test_the_base_model_after_an_adapter_loads_only_its_own_blocks(first):
    prompt = [t + 7 for t in PROMPT]
    ada = first.complete(prompt, model="ada")
    alone = first.complete(prompt, salt="base-alone")
    first.reset_prefix_cache()
    base = first.complete(prompt)
    assert ada["cached_tokens"] == 0 and base["cached_tokens"] == 0
    assert base["tokens"] == alone["tokens"] and alone["logprobs"] != ada["logprobs"]


def test_prompt_embeddings_key_their_blocks(first):
    e1 = first.complete(None, extra={"prompt_embeds": _embeds(1)})
    e2_alone = first.complete(None, salt="e2-alone", extra={"prompt_embeds": _embeds(2)})
    first.reset_prefix_cache()
    e2 = first.complete(None, extra={"prompt_embeds": _embeds(2)})
    assert e2["cached_tokens"] == 0 and e2["tokens"] == e2_alone["tokens"]  # same length, other inputs
    first.reset_prefix_cache()
    again = first.complete(None, extra={"prompt_embeds": _embeds(1)})
    assert again["cached_tokens"] == HIT and again["tokens"] == e1["tokens"]


def test_other_weights_under_the_same_name_are_served_nothing(fleet, first):
    base_a = first.answers["base"]
    first.stop()
    with fleet.server(fleet.b, "b") as b:
        alone = b.complete(PROMPT, salt="b-alone")
        got = b.complete(PROMPT)
        assert got["cached_tokens"] == 0 and got["tokens"] == alone["tokens"]
        assert alone["logprobs"] != base_a["logprobs"]  # other weights: another answer
        live = list(fleet.daemon.stats()["namespaces"].values())
        assert {ns["model"] for ns in live} == {"tiny-llama"} and all(ns["identity"] for ns in live)


def test_the_same_weights_in_another_directory_are_served_every_block(fleet, first):
    base_a = first.answers["base"]
    first.stop()
    with fleet.server(fleet.c, "c") as c:
        got = c.complete(PROMPT)
        assert got["cached_tokens"] == HIT and got["tokens"] == base_a["tokens"]

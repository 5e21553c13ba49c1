"""Small random-weight models of the architectures vLLM serves with more than plain attention, made by the
tests themselves (a transformers config, random weights, ``save_pretrained``; nothing is downloaded).

Each borrows the demo model's tokenizer (SmolLM2's, 49,152 tokens) so prompts tokenize as in the other
vLLM tests. The weights are seeded: the same call makes the same model.

* ``gemma3``: Gemma-3 text, sliding-window and full-attention layers interleaved (vLLM: two KV cache
  groups, one per attention type).
* ``mistral``: Mistral with a sliding window on every layer (one group, sliding window).
* ``deepseek``: DeepSeek-V2-style multi-head latent attention (a 512 + 64 latent, vLLM's CPU MLA backend).
* ``llama``: plain Llama with 2 KV heads (one per rank at tensor parallelism 2).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from tierkv.integrations.model import ensure_converted

VOCAB = 49152
WINDOW = 256  # tokens a sliding-window layer attends to: two of vLLM's 128-token CPU blocks
ARCHS = ("gemma3", "mistral", "deepseek", "llama")


def _config(arch: str) -> Any:
    common: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                  max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                  tie_word_embeddings=False, initializer_range=0.1)
    if arch == "gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(**common, num_hidden_layers=4, num_key_value_heads=2, head_dim=64,
                                sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
                                query_pre_attn_scalar=64)
    if arch == "mistral":
        from transformers import MistralConfig

        return MistralConfig(**common, num_hidden_layers=3, num_key_value_heads=2, head_dim=32,
                             sliding_window=WINDOW)
    if arch == "deepseek":
        from transformers import DeepseekV2Config

        return DeepseekV2Config(**common, num_hidden_layers=2, num_key_value_heads=4, kv_lora_rank=512,
                                q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                                first_k_dense_replace=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                moe_intermediate_size=64)
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common, num_hidden_layers=3, num_key_value_heads=2, head_dim=32)
    raise ValueError(f"unknown architecture {arch!r}; one of {ARCHS}")


def make(arch: str, root: Path, seed: int = 0) -> Path:
    """Build (once) the random-weight model ``arch`` under ``root`` and return its directory."""
    out = Path(root) / f"tiny-{arch}"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    AutoTokenizer.from_pretrained(str(ensure_converted())).save_pretrained(str(tmp))
    tmp.rename(out)
    return out


def layer_groups(arch: str, model_dir: Path) -> dict[str, list[int]]:
    """The layers of each kind of KV cache group vLLM makes of ``arch`` (``full``, ``sliding``, ``mla``)."""
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    layers = list(range(cfg["num_hidden_layers"]))
    if arch == "gemma3":
        types = cfg["layer_types"]
        return {"sliding": [i for i in layers if types[i] == "sliding_attention"],
                "full": [i for i in layers if types[i] == "full_attention"]}
    return {"sliding" if arch == "mistral" else "mla": layers}


def reference_kv(model_dir: Path, tokens: list[int]) -> list[Any]:
    """What each layer caches for ``tokens``, computed by transformers (float32, eager): per layer ``[2,
    kv_heads, tokens, head_dim]`` (K then V) or, for MLA, ``[1, 1, tokens, kv_lora_rank + rope]`` (the
    normalized latent, then the rotated shared key part: what transformers' DeepSeek-V2 caches too)."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    cache = DynamicCache(config=model.config)
    seen: dict[int, Any] = {}
    update = cache.update

    def capture(first: Any, second: Any, layer_idx: int, *args: Any, **kw: Any) -> Any:
        # whole, before a sliding layer's cache drops what its window no longer reaches
        same = first.shape[-1] == second.shape[-1] and first.shape[1] == second.shape[1]
        seen[layer_idx] = torch.stack([first[0], second[0]]) if same else torch.cat([first, second], -1)
        return update(first, second, layer_idx, *args, **kw)

    cache.update = capture  # type: ignore[method-assign]
    with torch.inference_mode():
        model(torch.tensor([tokens]), past_key_values=cache, use_cache=True)
    return [seen[i].clone() for i in range(len(seen))]

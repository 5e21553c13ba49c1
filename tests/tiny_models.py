"""Small random-weight models of the architectures vLLM serves with more than plain attention, made by the
tests themselves (``tools/_random_models.py`` at size ``tiny``: Gemma-3 text with sliding and full
layers interleaved, Mistral with a window on every layer, DeepSeek-V2-style MLA), and what the tests check
them against: each kind of KV cache group's layers, and the K/V transformers computes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _random_models import ARCHS, VOCAB, WINDOW, make

__all__ = ["ARCHS", "VOCAB", "WINDOW", "layer_groups", "make", "reference_kv"]


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

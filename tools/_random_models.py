"""Random-weight models of the architectures vLLM serves with more than plain attention (a transformers
config, seeded random weights, ``save_pretrained``; nothing is downloaded), for the tests
(``tests/system/test_vllm_models.py``, size ``tiny``) and ``tools/bench_models.py`` (size ``bench``).

Each borrows the demo model's tokenizer (SmolLM2's, 49,152 tokens). The same call makes the same model.

* ``gemma3``: Gemma-3 text, sliding-window and full-attention layers interleaved (vLLM: two KV cache
  groups, one per attention type).
* ``mistral``: Mistral with a sliding window on every layer (one group, sliding window).
* ``deepseek``: DeepSeek-V2-style multi-head latent attention (a 512 + 64 latent, vLLM's CPU MLA backend).
* ``llama``: plain Llama with an even number of KV heads (split across ranks at tensor parallelism 2).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from _demo_model import ensure_converted

__all__ = ["ARCHS", "SIZES", "VOCAB", "WINDOW", "config", "make"]

VOCAB = 49152
ARCHS = ("gemma3", "mistral", "deepseek", "llama")
# per size: the shape shared by every architecture, then each architecture's own
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"window": 256, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
             "gemma3": dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=64, pattern=1),
             "mistral": dict(num_hidden_layers=3, num_key_value_heads=2, head_dim=32),
             "deepseek": dict(num_hidden_layers=2, num_key_value_heads=4, qk_nope_head_dim=32, v_head_dim=32,
                              first_k_dense_replace=2, n_routed_experts=4, moe_intermediate_size=64),
             "llama": dict(num_hidden_layers=3, num_key_value_heads=2, head_dim=32)},
    "bench": {"window": 512, "hidden_size": 512, "intermediate_size": 1536, "num_attention_heads": 8,
              "gemma3": dict(num_hidden_layers=12, num_key_value_heads=4, head_dim=64, pattern=5),
              "mistral": dict(num_hidden_layers=12, num_key_value_heads=4, head_dim=64),
              "deepseek": dict(num_hidden_layers=8, num_key_value_heads=8, qk_nope_head_dim=64, v_head_dim=64,
                               first_k_dense_replace=8, n_routed_experts=4, moe_intermediate_size=64)},
}
WINDOW = SIZES["tiny"]["window"]  # tokens a tiny sliding-window layer attends to: two 128-token CPU blocks


def config(arch: str, size: str = "tiny") -> Any:
    """The transformers config of ``arch`` at ``size`` (a key of :data:`SIZES`)."""
    s = SIZES[size]
    common: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=s["hidden_size"],
                                  intermediate_size=s["intermediate_size"],
                                  num_attention_heads=s["num_attention_heads"], max_position_embeddings=4096,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                                  initializer_range=0.1)
    own = dict(s.get(arch, {}))
    if arch == "gemma3":
        from transformers import Gemma3TextConfig

        pattern = own.pop("pattern")  # sliding layers per full one
        types = (["sliding_attention"] * pattern + ["full_attention"]) * (own["num_hidden_layers"] // (pattern + 1))
        return Gemma3TextConfig(**common, **own, sliding_window=s["window"], layer_types=types,
                                query_pre_attn_scalar=own["head_dim"])
    if arch == "mistral":
        from transformers import MistralConfig

        return MistralConfig(**common, **own, sliding_window=s["window"])
    if arch == "deepseek":
        from transformers import DeepseekV2Config

        return DeepseekV2Config(**common, **own, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                                n_shared_experts=1, num_experts_per_tok=2)
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common, **own)
    raise ValueError(f"unknown architecture {arch!r}; one of {ARCHS}")


def make(arch: str, root: Path, seed: int = 0, size: str = "tiny") -> Path:
    """Build (once) the random-weight model ``arch`` at ``size`` under ``root`` and return its directory."""
    out = Path(root) / f"{size}-{arch}"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(arch, size), dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    AutoTokenizer.from_pretrained(str(ensure_converted())).save_pretrained(str(tmp))
    tmp.rename(out)
    return out

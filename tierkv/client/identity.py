"""A model's identity: what its KV depends on, as one digest that goes into the namespace.

Two engines get the same identity, and share blocks, when their weights are equal
(:mod:`tierkv.client.weights`) and so is every setting that changes K or V: the model's config (its
architecture, attention and rope settings and scaling, sliding windows, quantization; fields that do not
change K or V, such as token ids of special tokens or the config's own path, are left out), the dtype it
runs in, the KV cache dtype, and the hub revision it was loaded at. Where the weights live, and the name
they are served under, do not count: the same weights in another directory or on another node share
blocks, other weights under the same name never do.

An adapter (LoRA) has an identity of its own, from its weights and config, so a request through it is
keyed apart from the base model and from other adapters (:func:`adapter_identity`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tierkv.client.weights import DigestCache, Mode, weights_digest

__all__ = ["IDENTITY_VERSION", "adapter_identity", "config_digest", "model_identity", "tensors_digest"]

IDENTITY_VERSION = 1
# Config fields that never change a layer's K or V (or that the runtime dtype replaces).
_IGNORED = frozenset({
    "_name_or_path", "name_or_path", "transformers_version", "_commit_hash", "_attn_implementation",
    "_attn_implementation_autoset", "attn_implementation", "use_cache", "output_attentions", "output_hidden_states",
    "return_dict", "torchscript", "torch_dtype", "dtype", "bos_token_id", "eos_token_id", "pad_token_id",
    "sep_token_id", "decoder_start_token_id", "task_specific_params", "id2label", "label2id", "problem_type",
    "tokenizer_class", "prefix", "finetuning_task", "chunk_size_feed_forward", "tie_word_embeddings",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "cross_attention_hidden_size",
    "add_cross_attention", "tie_encoder_decoder", "is_decoder", "pruned_heads",
})
# Adapter config fields that name where the base model was, not what the adapter is.
_ADAPTER_IGNORED = frozenset({"base_model_name_or_path", "revision", "inference_mode", "auto_mapping"})


def _canonical(value: Any, ignored: frozenset[str]) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _canonical(v, ignored) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))
                if str(k) not in ignored}
    if isinstance(value, list | tuple):
        return [_canonical(v, ignored) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def config_digest(config: Mapping[str, Any], ignored: frozenset[str] = _IGNORED) -> str:
    """A digest of the config fields that change K or V (nested configs too), key order aside."""
    text = json.dumps(_canonical(config, ignored), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def model_identity(*, weights: str, config: Mapping[str, Any], dtype: str, kv_cache_dtype: str = "auto",
                   revision: str | None = None, quantization: str | None = None,
                   extra: Mapping[str, Any] | None = None) -> str:
    """The identity (32 hex characters) of a model as an engine runs it.

    Args:
        weights: the digest of its weights (:func:`~tierkv.client.weights.weights_digest`, or
            :func:`tensors_digest` of the loaded tensors).
        config: its config as a dict (Hugging Face ``config.json``, after any overrides the engine applied).
        dtype: the dtype it computes in.
        kv_cache_dtype: the KV cache dtype (``auto``: the model's dtype).
        revision: the hub commit its files were loaded at, where there is one.
        quantization: the engine's quantization method, where one is set.
        extra: anything else of the engine's that changes K or V.
    """
    doc = {"v": IDENTITY_VERSION, "weights": weights, "config": config_digest(config), "dtype": str(dtype),
           "kv_cache_dtype": str(kv_cache_dtype), "revision": revision, "quantization": quantization,
           "extra": _canonical(dict(extra or {}), frozenset())}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def adapter_identity(path: str | os.PathLike[str], mode: Mode = "full", cache: DigestCache | None = None) -> str:
    """The identity (32 hex characters) of a PEFT adapter directory: its weights (every byte by default:
    adapters are small) and its config, without where the base model was.

    Raises:
        FileNotFoundError: no such directory, or no weight files in it.
        ValueError: its ``adapter_config.json`` is not JSON.
    """
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"no adapter directory at {p}")
    config: Any = {}
    cfg = p / "adapter_config.json"
    if cfg.exists():
        try:
            config = json.loads(cfg.read_text())
        except ValueError as exc:
            raise ValueError(f"{cfg} is not JSON: {exc}") from None
    weights = weights_digest(p, mode, cache)
    text = f"tierkv/adapter/v{IDENTITY_VERSION}|{weights}|{config_digest(config, _ADAPTER_IGNORED)}"
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def tensors_digest(tensors: Mapping[str, Any], window: int = 4096) -> str:
    """A digest of loaded tensors (a model's ``state_dict()``): every tensor's name, dtype and shape, and
    three windows of its bytes (start, middle, end; a small tensor whole), as a sampled file digest takes."""
    import torch

    h = hashlib.blake2b(b"tierkv/tensors/v1", digest_size=16)
    for name in sorted(tensors):
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            continue
        h.update(f"|{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if not t.numel():
            continue
        flat = t.detach().reshape(-1).contiguous().view(torch.uint8)
        n = flat.numel()
        spans = [(0, n)] if n <= 3 * window else [(0, window), ((n - window) // 2, window), (n - window, window)]
        for off, length in spans:
            h.update(flat[off:off + length].cpu().numpy().tobytes())
    return h.hexdigest()


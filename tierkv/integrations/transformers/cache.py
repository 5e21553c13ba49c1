"""transformers' KV cache and forward call, kept in one place so version drift touches only this module."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from tierkv.core.layout import Layout

DEFAULT_BLOCK_TOKENS = 16


def text_config(model: Any) -> Any:
    """The decoder config of a model (multimodal wrappers nest it)."""
    cfg = model.config
    getter = getattr(cfg, "get_text_config", None)
    if getter is not None:
        try:
            return getter(decoder=True)
        except TypeError:
            return getter()
    return cfg


def model_layout(model: Any, block_tokens: int = DEFAULT_BLOCK_TOKENS, dtype: Any = None) -> Layout:
    """The tierkv :class:`~tierkv.core.layout.Layout` of a model's KV cache.

    Args:
        model: a transformers causal LM.
        block_tokens: tokens per block.
        dtype: stored element type; default the model's dtype (what its cache holds).

    Raises:
        ValueError: the model has sliding-window or other non-full-attention layers, whose
            ``DynamicCache`` layers do not keep every token.
    """
    cfg = text_config(model)
    layer_types = getattr(cfg, "layer_types", None) or []
    odd = sorted({t for t in layer_types if t != "full_attention"})
    if odd or getattr(cfg, "use_sliding_window", False) or _sliding_cache(model):
        raise ValueError(f"only full-attention models are supported, this one has {odd or 'sliding windows'}")
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return Layout(num_layers=cfg.num_hidden_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                  block_tokens=block_tokens, dtype=dtype if dtype is not None else model.dtype)


def _sliding_cache(model: Any) -> bool:
    """Whether the model's own ``DynamicCache`` has sliding-window layers (configs do not always say)."""
    try:
        cache = new_cache(model)
    except (TypeError, AttributeError, ValueError, KeyError):
        return False
    return any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", []))


def new_cache(model: Any) -> Any:
    """An empty ``DynamicCache`` for ``model``."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # transformers < 4.56 takes no config
        return DynamicCache()


def layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, values)`` of one layer, each ``[batch, kv_heads, tokens, head_dim]``."""
    if hasattr(cache, "layers"):  # transformers >= 4.56: a list of cache layers
        lay = cache.layers[layer]
        return lay.keys, lay.values
    if hasattr(cache, "key_cache"):
        return cache.key_cache[layer], cache.value_cache[layer]
    return cache[layer][0], cache[layer][1]


def set_layer(cache: Any, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Make ``keys``/``values`` ([batch, kv_heads, tokens, head_dim]) the content of an empty cache layer.

    transformers' plain ``DynamicLayer`` takes the tensors as they are (``update`` would concatenate
    them onto an empty tensor: a second full copy); any other layer goes through ``cache.update``.
    """
    layers = getattr(cache, "layers", None)
    lay = layers[layer] if layers is not None and layer < len(layers) else None
    if lay is not None and type(lay).__name__ == "DynamicLayer" and not getattr(lay, "is_initialized", True):
        try:
            lay.lazy_initialization(keys, values)
            lay.keys, lay.values = keys, values
            if lay.get_seq_length() == keys.shape[-2]:
                return
        except (AttributeError, TypeError):
            pass
        lay.lazy_initialization(keys, values)  # back to empty, then the public way
    cache.update(keys, values, layer)


def cache_length(cache: Any) -> int:
    """Tokens held by the cache."""
    return int(cache.get_seq_length())


class Forward:
    """Calls a model for one step with a cache, across the keyword renames of transformers 5.x
    (``past_key_values`` -> ``cache``; ``logits_to_keep``)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keep_last = "logits_to_keep" in params or "num_logits_to_keep" in params
        self.keep_kw = "logits_to_keep" if "logits_to_keep" in params else "num_logits_to_keep"

    def __call__(self, input_ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        """Run ``input_ids`` ([1, n]) on top of ``cache``; return the last position's logits [vocab]
        and the (updated) cache."""
        kwargs: dict[str, Any] = {self.cache_kw: cache, "use_cache": True}
        if self.keep_last:  # skip the vocabulary projection of every position but the last
            kwargs[self.keep_kw] = 1
        with torch.inference_mode():
            out = self.model(input_ids=input_ids, **kwargs)
        new = getattr(out, "cache", None)
        if new is None:
            new = getattr(out, "past_key_values", None)
        return out.logits[0, -1], (new if new is not None else cache)


def eos_ids(model: Any, eos_token_id: int | Sequence[int] | None) -> set[int]:
    """The end-of-sequence ids to stop at: the argument, else the model's generation config."""
    if eos_token_id is None:
        gc = getattr(model, "generation_config", None)
        eos_token_id = getattr(gc, "eos_token_id", None) if gc is not None else None
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(t) for t in eos_token_id}

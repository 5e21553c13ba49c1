"""vLLM's KV cache groups as tierkv namespaces, and the rule a lookup across them follows.

vLLM's hybrid allocator splits a model's attention layers into KV cache groups with one block table
each: full attention, sliding window (Gemma 2/3, gpt-oss, Mistral-style windows), MLA (one latent
vector per token, DeepSeek-V2/V3). tierkv keeps each group's blocks in a namespace of its own, laid out
by the group's spec (attention kind, window, KV heads, head size, dtype) and named after the group's
index, kind, window and layers, so one group's block is never served as another's.

A block position is cached when every group that needs it holds it: a full-attention group needs every
block before the first token to compute, a sliding-window group only the blocks that token's window
reaches (vLLM leaves its null block in the others). A position one group holds and another lacks is a
miss. This module reads vLLM's specs by their class names and attributes and imports no vLLM code.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tierkv.core.layout import Layout, dtype_name

__all__ = ["GroupSpec", "find_hit", "group_specs", "namespace_model"]

# KV cache dtypes whose pages hold fp8 values (vLLM keeps per-tensor scales in the model, not in pages)
_FP8 = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV cache group as tierkv stores it.

    Args:
        index: the group's index in vLLM's KV cache config.
        kind: ``"full"``, ``"sliding"`` or ``"mla"``.
        layout: the group's blocks (its layers only).
        layer_names: vLLM's names of the group's layers, in order.
        window: tokens the attention of a layer sees (None: all); part of the namespace.
        reach: a sliding-window group's allocation: tokens before the next one whose blocks vLLM keeps
            (``window - 1`` plus any it retains); None where vLLM keeps every block.
    """

    index: int
    kind: str
    layout: Layout
    layer_names: tuple[str, ...]
    window: int | None = None
    reach: int | None = None

    @property
    def tag(self) -> str:
        """The group's part of its namespace: index, kind, window, and a digest of its layer names."""
        digest = hashlib.blake2b("|".join(self.layer_names).encode(), digest_size=4).hexdigest()
        return f"g{self.index}.{self.kind}{self.window or ''}.{digest}"

    def first_needed(self, n_blocks: int) -> int:
        """The first of a hit's ``n_blocks`` leading blocks this group needs loaded (the rest vLLM never
        reads: its null block stands there)."""
        if self.reach is None:
            return 0
        return max(0, n_blocks * self.layout.block_tokens - self.reach) // self.layout.block_tokens


def namespace_model(model: str, groups: Sequence[GroupSpec]) -> list[str]:
    """The namespace model id of each group: ``model`` itself for a model with one full-attention group
    (every block is shared with tierkv's other integrations), ``model#tag`` otherwise."""
    if len(groups) == 1 and groups[0].kind == "full" and groups[0].window is None:
        return [model]
    return [f"{model}#{g.tag}" for g in groups]


def _classes(spec: Any) -> set[str]:
    return {c.__name__ for c in type(spec).__mro__}


def _refusal(spec: Any, classes: set[str]) -> str | None:
    """Why a spec cannot be served, or None."""
    name = type(spec).__name__
    if "AttentionSpec" not in classes or classes & {"CrossAttentionSpec", "EncoderOnlyAttentionSpec"}:
        return f"{name} groups (Mamba, linear attention, cross or encoder attention) are not supported"
    if "SlidingWindowMLASpec" in classes or getattr(spec, "attention_chunk_size", None) \
            or "ChunkedLocalAttentionSpec" in classes:
        return f"{name} (sliding-window MLA or chunked local attention) is not supported"
    if getattr(spec, "num_head_slots", None) is not None or getattr(spec, "state_content_bytes", None) is not None \
            or getattr(spec, "page_size_padded", None) is not None or getattr(spec, "tokens_per_state", 1) != 1:
        return f"{name} pages are packed or padded (a quantization with scales in the page, or DeepSeek-V4)"
    mode = getattr(spec, "kv_quant_mode", 0)
    if int(getattr(mode, "value", mode) or 0) not in (0, 1):  # NONE, FP8_PER_TENSOR
        return f"the KV cache quantization {getattr(mode, 'name', mode)} keeps scales in the pages"
    return None


def _dtype(spec: Any, cache_dtype: str) -> str:
    if cache_dtype in _FP8:  # fp8 pages may be typed uint8: name them by the fp8 format they hold
        return _FP8[cache_dtype]
    return dtype_name(spec.dtype)


def _one(index: int, group: Any, cache_dtype: str) -> GroupSpec | str:
    spec, names = group.kv_cache_spec, tuple(group.layer_names)
    if getattr(group, "is_eagle_group", False) or getattr(group, "host_resident", False) \
            or not getattr(group, "enable_kv_transfer", True):
        return "draft-model (EAGLE/MTP), host-resident and non-transferable groups are not supported"
    classes = _classes(spec)
    why = _refusal(spec, classes)
    if why:
        return why
    dtype = _dtype(spec, cache_dtype)
    bt, heads, head = int(spec.block_size), int(spec.num_kv_heads), int(spec.head_size)
    if "MLAAttentionSpec" in classes:
        return GroupSpec(index, "mla", Layout(len(names), 1, head, bt, dtype, kind="latent"), names)
    if int(getattr(spec, "head_size_v", head)) != head:
        return f"K and V of different head sizes ({head}, {spec.head_size_v}) are not supported"
    layout = Layout(len(names), heads, head, bt, dtype)
    window = getattr(spec, "sliding_window", None)
    if "SlidingWindowSpec" in classes:
        if window is None:
            return f"sliding-window spec {type(spec).__name__} without a window"
        reach = int(window) - 1 + int(getattr(spec, "extra_retained_tokens", 0) or 0)
        return GroupSpec(index, "sliding", layout, names, int(window), reach)
    # a full-attention allocation whose layers slide (vLLM's hybrid allocator off): every block is kept
    return GroupSpec(index, "full", layout, names, int(window) if window else None)


def group_specs(kv_cache_config: Any, cache_dtype: str = "auto") -> tuple[list[GroupSpec], str]:
    """tierkv's view of vLLM's KV cache groups, or ``([], why)`` when one of them cannot be served.

    Args:
        kv_cache_config: vLLM's ``KVCacheConfig`` (its ``kv_cache_groups``: ``kv_cache_spec``, ``layer_names``).
        cache_dtype: vLLM's ``--kv-cache-dtype`` (``auto``, ``fp8``, ``fp8_e4m3``, ``fp8_e5m2``, ...).
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
    if not groups:
        return [], "no KV cache groups"
    out: list[GroupSpec] = []
    for i, group in enumerate(groups):
        try:
            one = _one(i, group, cache_dtype)
        except (ValueError, TypeError, AttributeError) as exc:
            return [], f"group {i}: {exc}"
        if isinstance(one, str):
            return [], f"group {i}: {one}"
        out.append(one)
    sizes = {g.layout.block_tokens for g in out}
    if len(sizes) > 1:
        return [], f"groups of different block sizes {sorted(sizes)} are not supported"
    return out, ""


def find_hit(groups: Sequence[GroupSpec], lookups: Sequence[Callable[[int, int], int]], first: int,
             limit: int) -> int:
    """The most leading blocks, at most ``limit``, the groups serve together, vLLM holding ``first``.

    Args:
        groups: the groups.
        lookups: per group, ``lookup(lo, hi)``: how many of its blocks ``lo .. hi - 1`` are cached, counted
            from ``lo`` up to the first missing one.
        first: leading blocks vLLM holds itself (a sliding-window group's load starts there at the earliest).
        limit: the most blocks a hit may have.

    Returns:
        The largest ``n`` such that every full-attention group holds blocks ``0 .. n - 1`` and every
        sliding-window group the blocks from ``max(first, its window's first block)`` to ``n - 1``; when
        that is ``first`` or less, some ``n <= first``.
    """
    n = limit
    for g, lookup in zip(groups, lookups):
        if g.reach is None and n > 0:
            n = min(n, lookup(0, n))
    while n > first:
        for g, lookup in zip(groups, lookups):
            if g.reach is None:
                continue
            lo = max(first, g.first_needed(n))
            have = lookup(lo, n)
            if have < n - lo:  # block lo + have is missing: no hit may need it
                n = lo + have
                break
        else:
            return n
    return n

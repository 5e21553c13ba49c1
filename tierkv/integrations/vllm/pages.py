"""vLLM's paged KV caches seen as tierkv blocks: the copies between them, one pass per step.

vLLM hands the connector one tensor per attention layer, logically ``[num_blocks, kv_heads,
block_tokens, 2 * head_dim]``. What the last axis holds depends on the backend:

* CUDA backends (flash-attn and the like): K is ``[..., :head_dim]`` and V ``[..., head_dim:]`` of each
  token row; the physical axis order may differ (NHD, HND), which the strides carry. The copies run
  in :mod:`tierkv.client.paged` (one kernel launch for all blocks, layers, K and V).
* The CPU backend: inside a block and head, K is stored transposed (``[head_dim, block_tokens]``) and
  followed by V (``[block_tokens, head_dim]``); row ``n`` is not token ``n``. :func:`cpu_layout_ok`
  checks this against vLLM's own cache-write kernel before any block is shared.
* MLA backends (CPU and CUDA): one latent vector per token, ``[num_blocks, block_tokens, latent]`` (or with
  a head axis of one), token rows in order.

tierkv keeps a block as ``[2, layers, kv_heads, block_tokens, head_dim]`` (K then V, heads first), the
layout every engine integration and codec shares; an MLA block as ``[1, layers, 1, block_tokens, latent]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tierkv.client.paged import _bits, _copy_all, gather, scatter
from tierkv.core.layout import Layout, dtype_name, torch_dtype

__all__ = ["VllmPages", "cpu_layout_ok"]


class VllmPages:
    """The per-layer caches of one vLLM worker and the block copies between them and tierkv slots.

    Args:
        caches: the layers' cache tensors in layer order, as ``register_kv_caches`` gives them.
        head_dim: the model's head size (the last axis holds ``2 * head_dim``; an MLA latent's width).
        kind: ``"kv"`` or ``"latent"`` (MLA: the last axis is the latent, one head).
        dtype: the element type to name the layout by (e.g. an fp8 format held in ``uint8`` pages); it
            must have the tensors' element size. None: the tensors' dtype.

    Raises:
        ValueError: the tensors do not share one shape, dtype and device, or have the wrong shape.
    """

    def __init__(self, caches: Sequence[torch.Tensor], head_dim: int, kind: str = "kv", dtype: str | None = None) -> None:
        if not caches:
            raise ValueError("no KV cache tensors")
        if kind == "latent":  # [blocks, tokens, latent] or [blocks, 1, tokens, latent]
            caches = [c.unsqueeze(1) if c.dim() == 3 else c for c in caches]
        first = caches[0]
        for c in caches:
            if c.dim() != 4 or c.shape != first.shape or c.dtype != first.dtype or c.device != first.device:
                raise ValueError(f"KV cache tensors must be 4-D of one shape, dtype and device, got "
                                 f"{tuple(c.shape)} {c.dtype} {c.device} beside {tuple(first.shape)}")
        nb, heads, tokens, width = (int(s) for s in first.shape)
        planes = 1 if kind == "latent" else 2
        if width != planes * head_dim:
            raise ValueError(f"last axis is {width}, expected {planes} * head_dim = {planes * head_dim}")
        if kind == "latent" and heads != 1:
            raise ValueError(f"latent pages have one head, got {heads}")
        name = dtype_name(dtype or first.dtype)
        if torch_dtype(name).itemsize != first.element_size():
            raise ValueError(f"{name} does not fit pages of {first.dtype}")
        self.caches = list(caches)
        self.device = first.device
        self.num_blocks = nb
        self.layout = Layout(len(caches), heads, head_dim, tokens, name, kind=kind)
        self._cpu = self.device.type == "cpu"
        if kind == "latent":
            self._k, self._v = list(self.caches), list[torch.Tensor]()
        elif self._cpu:
            self._k, self._v = self._cpu_views()
        else:
            self._k = [c[..., :head_dim] for c in self.caches]
            self._v = [c[..., head_dim:] for c in self.caches]

    def _cpu_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, K as ``[blocks, heads, head_dim, tokens]`` and V as ``[blocks, heads, tokens, head_dim]``."""
        lo = self.layout
        page = lo.block_tokens * lo.head_dim
        ks, vs = [], []
        for c in self.caches:
            if not c[0].is_contiguous():
                raise ValueError("each block of a CPU KV cache must be contiguous")
            flat = _bits(c).view(self.num_blocks, lo.num_kv_heads, 2 * page)
            ks.append(flat[:, :, :page].view(self.num_blocks, lo.num_kv_heads, lo.head_dim, lo.block_tokens))
            vs.append(flat[:, :, page:].view(self.num_blocks, lo.num_kv_heads, lo.block_tokens, lo.head_dim))
        return ks, vs

    def _check_ids(self, block_ids: Sequence[int]) -> list[int]:
        ids = [int(b) for b in block_ids]
        if ids and (min(ids) < 0 or max(ids) >= self.num_blocks):
            raise ValueError(f"block ids must be in [0, {self.num_blocks}), got {min(ids)}..{max(ids)}")
        return ids

    def gather(self, block_ids: Sequence[int], out: Sequence[torch.Tensor]) -> None:
        """Copy vLLM blocks ``block_ids`` into tierkv blocks ``out`` (each ``[2, L, H, T, D]``)."""
        ids = self._check_ids(block_ids)
        if len(out) != len(ids):
            raise ValueError(f"{len(out)} destination blocks for {len(ids)} block ids")
        if not ids:
            return
        if not self._v:
            self._copy_latent(ids, out, gather=True)
            return
        if not self._cpu:
            direct = all(b.device == self.device or b.is_pinned() for b in out)
            stage = list(out) if direct else [torch.empty_like(b, device=self.device) for b in out]
            gather(self._k, self._v, ids, stage, layout="HND")
            if not direct:  # host slots this process has not pinned: one device-to-host copy each
                torch._foreach_copy_(list(out), stage)
            return
        dst = [_bits(b) for b in out]
        for layer in range(self.layout.num_layers):
            k, v = self._k[layer], self._v[layer]
            _copy_all([d[0, layer].transpose(-1, -2) for d in dst], [k[b] for b in ids])
            _copy_all([d[1, layer] for d in dst], [v[b] for b in ids])

    def scatter(self, blocks: Sequence[torch.Tensor], block_ids: Sequence[int]) -> None:
        """Copy tierkv blocks (each ``[2, L, H, T, D]``) into vLLM blocks ``block_ids``."""
        ids = self._check_ids(block_ids)
        if len(blocks) != len(ids):
            raise ValueError(f"{len(blocks)} blocks for {len(ids)} block ids")
        if len(set(ids)) != len(ids):
            raise ValueError("block ids repeat: two blocks cannot go into one vLLM block")
        if not ids:
            return
        if not self._v:
            self._copy_latent(ids, blocks, gather=False)
            return
        if not self._cpu:
            direct = all(b.device == self.device or b.is_pinned() for b in blocks)
            src = list(blocks) if direct else [b.to(self.device) for b in blocks]
            scatter(src, self._k, self._v, ids, layout="HND")
            return
        src = [_bits(b) for b in blocks]
        for layer in range(self.layout.num_layers):
            k, v = self._k[layer], self._v[layer]
            _copy_all([k[b] for b in ids], [s[0, layer].transpose(-1, -2) for s in src])
            _copy_all([v[b] for b in ids], [s[1, layer] for s in src])

    def _copy_latent(self, ids: list[int], blocks: Sequence[torch.Tensor], gather: bool) -> None:
        """Latent pages: token rows in order, one page per layer and block (batched copies; on a GPU each
        block goes through one staging copy per direction when the block is in host memory)."""
        staged = [b if b.device == self.device else torch.empty_like(b, device=self.device) for b in blocks]
        if not gather:
            for s, b in zip(staged, blocks):
                if s is not b:
                    s.copy_(b)
        views = [_bits(b) for b in staged]
        for layer, cache in enumerate(self._k):
            pages = [_bits(cache)[b] for b in ids]
            mine = [v[0, layer] for v in views]
            if gather:
                _copy_all(mine, pages)
            else:
                _copy_all(pages, mine)
        if gather:
            for s, b in zip(staged, blocks):
                if s is not b:
                    b.copy_(s)

    def synchronize(self) -> None:
        """Wait for queued device copies (a no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def cpu_layout_ok(pages: VllmPages, write_op: Any, isa: str, src_dtype: torch.dtype | None = None,
                  kv_cache_dtype: str = "auto") -> bool:
    """Whether vLLM's CPU cache-write kernel puts K and V where :class:`VllmPages` reads them.

    Writes a known pattern for one block with ``write_op`` (vLLM's ``cpu_attn_reshape_and_cache``) into
    a scratch cache of the same geometry, gathers it, and compares byte for byte. An fp8 cache is written
    from the model's dtype (``src_dtype``) with unit scales, as vLLM's attention layer writes it.
    """
    lo = pages.layout
    h, t, d = lo.num_kv_heads, lo.block_tokens, lo.head_dim
    fp8 = lo.dtype.startswith("float8")  # vLLM's CPU fp8 cache is uint8 tensors holding fp8 bytes
    scratch = torch.zeros((1, h, t, 2 * d), dtype=torch.uint8 if fp8 else lo.torch_dtype)
    grid = torch.arange(t * h * d, dtype=torch.float32).view(t, h, d) % 251
    if fp8:  # values the fp8 format holds exactly: the kernel's rounding cannot blur the comparison
        exact = torch.arange(256, dtype=torch.uint8).view(lo.torch_dtype).float()
        exact = exact[torch.isfinite(exact) & (exact > 0) & (exact < 256)].unique()
        grid = exact[torch.arange(t * h * d) % len(exact)].view(t, h, d)
    src = src_dtype or lo.torch_dtype
    key, value = grid.to(src), (-grid if fp8 else -grid - 1).to(src)
    kv = scratch.view(1, h, 2 * t, d)
    key_cache, value_cache = kv.chunk(2, dim=2)
    if fp8:
        write_op(key, value, key_cache, value_cache, torch.arange(t, dtype=torch.int64), isa,
                 k_scale=1.0, v_scale=1.0, kv_cache_dtype=kv_cache_dtype)
    else:
        write_op(key, value, key_cache, value_cache, torch.arange(t, dtype=torch.int64), isa)
    probe = VllmPages([scratch], d, dtype=lo.dtype)
    out = torch.empty(lo.block_shape[:1] + (1,) + lo.block_shape[2:], dtype=lo.torch_dtype)
    probe.gather([0], [out])

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool(torch.equal(a.contiguous().view(torch.uint8), b.to(lo.torch_dtype).contiguous().view(torch.uint8)))
    return same(out[0, 0], key.transpose(0, 1)) and same(out[1, 0], value.transpose(0, 1))

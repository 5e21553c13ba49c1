"""The CPU path: batched torch copies on integer views of the bytes, so every dtype is copied bit for bit."""

from __future__ import annotations

import torch

from tierkv.client.paged.geometry import Geometry

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size."""
    # Integer views copy bytes exactly (NaN payloads, fp8) and every dtype takes the same kernels.
    return t.view(_BITS[t.element_size()])


def _layer_view(batch: torch.Tensor, kv: int, layer: int, layout: str) -> torch.Tensor:
    """``batch[:, kv, layer]`` ([n, H, T, D]) seen in the engine's axis order."""
    v = batch[:, kv, layer]
    return v.transpose(1, 2) if layout == "NHD" else v


copy_all = getattr(torch, "_foreach_copy_", None) or (lambda dsts, srcs: [d.copy_(s) for d, s in zip(dsts, srcs)])
# Pages staged per layer when gathering into slots: small enough to stay in cache and to be recycled by the
# allocator without fresh page faults.
_STAGE_BYTES = 4 << 20


def _pages(blocks: list[torch.Tensor], geo: Geometry, layout: str) -> list[tuple[torch.Tensor, ...]]:
    """Per block, its 2L pages ([H, T, D], seen in the engine's axis order), made in one call per block."""
    flat = [b.view(2 * geo.num_layers, geo.heads, geo.tokens, geo.head_dim).unbind(0) for b in blocks]
    if layout == "NHD":
        flat = [tuple(p.transpose(0, 1) for p in pages) for pages in flat]
    return flat


def cpu_gather(geo: Geometry, ks: list[torch.Tensor], vs: list[torch.Tensor], ids: torch.Tensor,
               blocks: torch.Tensor | list[torch.Tensor], layout: str) -> None:
    """Engine pages -> tierkv blocks on the CPU."""
    if isinstance(blocks, torch.Tensor):
        dst = bits(blocks)
        for kv, caches in enumerate((ks, vs)):
            for layer, cache in enumerate(caches):
                # index_select writes a strided out= in place: one pass, no temporary.
                torch.index_select(bits(cache), 0, ids, out=_layer_view(dst, kv, layer, layout))
        return
    # Slots are separate tensors: per layer, index_select into a small cache-resident stage in tierkv
    # order, then one batched copy stage -> slots. Faster than copying page by page from the caches, and
    # than staging whole blocks (a big fresh buffer costs page faults).
    page_elems = geo.heads * geo.tokens * geo.head_dim
    group = max(1, _STAGE_BYTES // (page_elems * geo.itemsize))
    dsts = [bits(b) for b in blocks]
    for g0 in range(0, geo.n, group):
        sub, part = ids[g0:g0 + group], dsts[g0:g0 + group]
        stage = torch.empty((len(part), geo.heads, geo.tokens, geo.head_dim), dtype=dsts[0].dtype)
        stage_in = stage.transpose(1, 2) if layout == "NHD" else stage
        stage_pages = stage.unbind(0)
        slot_pages = [d.view(2 * geo.num_layers, geo.heads, geo.tokens, geo.head_dim).unbind(0) for d in part]
        for r, cache in enumerate(ks + vs):
            torch.index_select(bits(cache), 0, sub, out=stage_in)
            copy_all([p[r] for p in slot_pages], stage_pages)


def cpu_scatter(geo: Geometry, ks: list[torch.Tensor], vs: list[torch.Tensor], ids: torch.Tensor,
                blocks: torch.Tensor | list[torch.Tensor], layout: str) -> None:
    """tierkv blocks -> engine pages on the CPU."""
    # Batched page copies run faster than index_copy_ on CPU (measured, torch 2.13).
    srcs = list(bits(blocks).unbind(0)) if isinstance(blocks, torch.Tensor) else [bits(b) for b in blocks]
    pages, idl = _pages(srcs, geo, layout), ids.tolist()
    for r, cache in enumerate(ks + vs):
        c = bits(cache)
        copy_all([c.select(0, b) for b in idl], [p[r] for p in pages])

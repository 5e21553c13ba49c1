"""Argument checks of a paged gather/scatter and the geometry they derive (shared by the CPU and CUDA paths)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class Geometry:
    """Shapes, dtype, device and engine strides of one checked gather/scatter call."""

    n: int
    num_layers: int
    heads: int
    tokens: int
    head_dim: int
    num_engine_blocks: int
    dtype: torch.dtype
    device: torch.device
    # Engine strides in elements, shared by every layer's K and V.
    s_blk: int
    s_tok: int
    s_head: int

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (2, self.num_layers, self.heads, self.tokens, self.head_dim)

    @property
    def block_elems(self) -> int:
        return 2 * self.num_layers * self.heads * self.tokens * self.head_dim


def tok_head_dims(layout: str) -> tuple[int, int]:
    """The token and head axes of an engine page in ``layout`` (``ValueError`` for another layout)."""
    if layout == "NHD":
        return 1, 2
    if layout == "HND":
        return 2, 1
    raise ValueError(f"layout must be 'NHD' or 'HND', got {layout!r}")


def as_layers(caches: Any, what: str) -> list[torch.Tensor]:
    """Per-layer cache tensors from a list or one ``[L, ...]`` tensor; ``ValueError`` otherwise."""
    if isinstance(caches, torch.Tensor):
        if caches.dim() != 5:
            raise ValueError(f"{what} as one tensor must be [layers, blocks, ., ., head_dim], got {tuple(caches.shape)}")
        return list(caches.unbind(0))
    if not isinstance(caches, Sequence) or not caches:
        raise ValueError(f"{what} must be a non-empty list of per-layer tensors")
    if not all(isinstance(c, torch.Tensor) for c in caches):
        raise ValueError(f"{what} must hold torch tensors")
    return list(caches)


def check_args(k_caches: Any, v_caches: Any, block_ids: Any, blocks: Any, layout: str, *, to_engine: bool,
               check_ids: bool = True) -> tuple[Geometry, list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor | list[torch.Tensor]]:
    """Check a gather/scatter call; returns its geometry, the K and V layers, the ids and the blocks."""
    t_dim, h_dim = tok_head_dims(layout)
    ks = as_layers(k_caches, "k_caches")
    vs = as_layers(v_caches, "v_caches")
    if len(ks) != len(vs):
        raise ValueError(f"{len(ks)} K layers but {len(vs)} V layers")
    first = ks[0]
    if first.dim() != 4:
        raise ValueError(f"engine caches must be 4-D [blocks, ., ., head_dim], got {tuple(first.shape)}")
    # One signature per tensor: this runs on every call, for every layer.
    sig0 = (first.shape, first.stride(), first.dtype, first.device)
    for c in ks + vs:
        sig = (c.shape, c.stride(), c.dtype, c.device)
        if sig != sig0:
            raise ValueError(f"engine caches must share shape, strides, dtype and device: "
                             f"{tuple(sig[0]), *sig[1:]} vs {tuple(sig0[0]), *sig0[1:]}")
    if first.shape[3] > 1 and first.stride(3) != 1:
        raise ValueError("engine caches must have head_dim contiguous (stride 1)")
    device = first.device
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device}")
    num_blocks = int(first.shape[0])
    geo_args: dict[str, Any] = dict(num_layers=len(ks), heads=int(first.shape[h_dim]), tokens=int(first.shape[t_dim]),
                    head_dim=int(first.shape[3]), num_engine_blocks=num_blocks, dtype=first.dtype,
                    device=device, s_blk=first.stride(0), s_tok=first.stride(t_dim), s_head=first.stride(h_dim))

    ids = block_ids_tensor(block_ids, device)
    n = int(ids.numel())
    geo = Geometry(n=n, **geo_args)
    if check_ids or ids.device.type == "cpu":  # host ids cost nothing to check
        check_ids_range(ids, geo, unique=to_engine)
    checked = check_blocks(blocks, geo, writes=not to_engine)
    return geo, ks, vs, ids, checked


def block_ids_tensor(block_ids: Any, device: torch.device) -> torch.Tensor:
    """Block ids as a 1-D int64 tensor, on the CPU or on the caches' device."""
    if isinstance(block_ids, torch.Tensor):
        ids = block_ids
    else:
        arr = np.asarray(block_ids)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"block_ids must be integers, got dtype {arr.dtype}")
        ids = torch.from_numpy(arr.astype(np.int64, copy=False))
    if ids.dim() != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {tuple(ids.shape)}")
    if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise ValueError(f"block_ids must be integers, got {ids.dtype}")
    if ids.device.type != "cpu" and ids.device != device:
        raise ValueError(f"block_ids on {ids.device} but caches on {device}")
    return ids.to(torch.int64).contiguous()


def check_ids_range(ids: torch.Tensor, geo: Geometry, *, unique: bool) -> None:
    """Ids within the engine's blocks, and distinct when ``unique`` (scatter)."""
    if not geo.n:
        return
    host = ids if ids.device.type == "cpu" else ids.cpu()  # one sync when ids live on the GPU
    lo, hi = (int(v) for v in torch.aminmax(host))
    if lo < 0 or hi >= geo.num_engine_blocks:
        raise ValueError(f"block ids must be in [0, {geo.num_engine_blocks}), got range [{lo}, {hi}]")
    if unique and torch.unique(host).numel() != geo.n:
        raise ValueError("block_ids repeat: scattering two blocks into one engine page is ambiguous")


def blocks_device_ok(t: torch.Tensor, device: torch.device) -> bool:
    """Whether the kernel can address blocks on ``t``'s device: the caches' one, or pinned host memory."""
    if t.device == device:
        return True
    # A CUDA kernel can address pinned (page-locked, registered) host memory directly.
    return device.type == "cuda" and t.device.type == "cpu" and t.is_pinned()


def check_blocks(blocks: Any, geo: Geometry, *, writes: bool) -> torch.Tensor | list[torch.Tensor]:
    """Check the tierkv blocks (a batch tensor or a list of block tensors) against ``geo``."""
    shape = geo.block_shape
    where = "pinned host memory or " if geo.device.type == "cuda" else ""
    if isinstance(blocks, torch.Tensor):
        if tuple(blocks.shape) != (geo.n, *shape):
            raise ValueError(f"blocks must have shape {(geo.n, *shape)}, got {tuple(blocks.shape)}")
        if blocks.dtype != geo.dtype:
            raise ValueError(f"blocks dtype {blocks.dtype} differs from the caches' {geo.dtype}")
        if not blocks_device_ok(blocks, geo.device):
            raise ValueError(f"blocks on {blocks.device} must be in {where}{geo.device}")
        if geo.n and not blocks[0].is_contiguous():
            raise ValueError("each block of the batch must be contiguous")
        if geo.n > 1 and blocks.stride(0) < geo.block_elems:
            raise ValueError("blocks of the batch overlap (stride(0) smaller than a block)")
        return blocks
    if not isinstance(blocks, Sequence) or isinstance(blocks, (str, bytes)):
        raise ValueError("blocks must be a tensor [n, 2, L, H, T, D] or a list of [2, L, H, T, D] tensors")
    if len(blocks) != geo.n:
        raise ValueError(f"{len(blocks)} blocks for {geo.n} block ids")
    out = list(blocks)
    size, dtype, device = torch.Size(shape), geo.dtype, geo.device
    for b in out:  # runs per block on every call: keep it to a few attribute reads
        if not isinstance(b, torch.Tensor) or b.shape != size:
            got = tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
            raise ValueError(f"each block must be a tensor of shape {shape}, got {got}")
        if b.dtype != dtype:
            raise ValueError(f"block dtype {b.dtype} differs from the caches' {dtype}")
        if b.device != device and not blocks_device_ok(b, device):
            raise ValueError(f"block on {b.device} must be in {where}{device}")
        if not b.is_contiguous():
            raise ValueError("each block must be contiguous")
    if writes and len({b.data_ptr() for b in out}) != len(out):
        raise ValueError("two destination blocks share memory")
    return out

"""Gather/scatter between an engine's paged KV cache and tierkv's contiguous blocks.

An engine (vLLM style) keeps, per layer, a K and a V tensor of pages: ``[num_blocks, block_tokens,
kv_heads, head_dim]`` (``layout="NHD"``) or ``[num_blocks, kv_heads, block_tokens, head_dim]``
(``layout="HND"``, flash-attn style). tierkv keeps one block contiguous as ``[2, layers, kv_heads,
block_tokens, head_dim]`` (see :class:`tierkv.core.layout.Layout`), either as a batch ``[n, 2, L, H, T, D]`` or
as a list of per-block tensors (slot views in a pool, not contiguous with each other).

* :func:`gather` copies engine pages -> tierkv blocks (offload), :func:`scatter` tierkv blocks -> engine
  pages (onboard).
* On CPU both run as a few batched torch ops per layer and K/V (``index_select``,
  ``torch._foreach_copy_``) on integer views of the bytes, so every dtype is copied bit for bit.
* On CUDA one kernel launch (``tierkv/_native/paged_kv.cu``) moves all blocks, layers, K and V. It is compiled at
  run time with ``cupy.RawModule`` (NVRTC) when cupy is installed, else with
  ``torch.utils.cpp_extension.load_inline`` (needs nvcc); ``TIERKV_PAGED_BACKEND=cupy|torch`` forces one.
  It runs on ``stream`` (default: the current stream) and returns without waiting. tierkv blocks may live
  on the caches' GPU or in pinned host memory (``pin_memory()`` or ``cudaHostRegister``, as the host
  pool is): the kernel then reads or writes host memory directly over the bus, so synchronise the stream
  before reading gathered host blocks.

Both paths share the argument checks (:mod:`tierkv.client.paged.geometry`); the kernel's launch
arguments come from :func:`kernel_plan`, which the tests also run on CPU tensors against a host build
of the same kernel source, so the index math is checked without a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch

from tierkv.client.paged.cpu import bits as _bits  # noqa: F401 - tierkv.integrations.vllm.pages uses it
from tierkv.client.paged.cpu import copy_all as _copy_all  # noqa: F401 - as _bits
from tierkv.client.paged.cpu import cpu_gather, cpu_scatter
from tierkv.client.paged.geometry import Geometry, as_layers, check_args, tok_head_dims
from tierkv.client.paged.kernel import (
    CUDA_ARCHS,
    KernelPlan,
    _arg_arrays,  # noqa: F401 - the kernel's host-build tests use it
    cuda_run,
    kernel_backend,
    kernel_source,
)
from tierkv.core.layout import Layout, dtype_name

EngineLayout = Literal["NHD", "HND"]

__all__ = ["CUDA_ARCHS", "EngineLayout", "KernelPlan", "engine_layout", "gather", "kernel_backend", "kernel_plan", "kernel_source",
           "scatter"]

# Rows per thread per loop trip; must match TKV_UNROLL in tierkv/_native/paged_kv.cu.
_UNROLL = 4
_THREADS = 256
_MAX_GRID_Y = 65535


def engine_layout(k_caches: Sequence[torch.Tensor], *, layout: EngineLayout = "NHD") -> Layout:
    """The tierkv :class:`~tierkv.core.layout.Layout` whose blocks hold pages of these caches.

    Args:
        k_caches: the engine's per-layer K caches.
        layout: ``"NHD"`` (``[blocks, tokens, heads, dim]``) or ``"HND"`` (``[blocks, heads, tokens, dim]``).

    Returns:
        The layout (layers, kv heads, head dim, block tokens, dtype).
    """
    ks = as_layers(k_caches, "k_caches")
    t, h = tok_head_dims(layout)
    shape = ks[0].shape
    if ks[0].dim() != 4:
        raise ValueError(f"k_caches[0] must be 4-D, got shape {tuple(shape)}")
    return Layout(len(ks), int(shape[h]), int(shape[3]), int(shape[t]), dtype_name(ks[0].dtype))


def gather(k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor], block_ids: Any,
           out: torch.Tensor | Sequence[torch.Tensor], *, layout: EngineLayout = "NHD",
           stream: torch.cuda.Stream | None = None, check_ids: bool = True) -> torch.Tensor | Sequence[torch.Tensor]:
    """Copy engine pages into tierkv blocks: ``out[i][kv, l] = cache[kv][l][block_ids[i]]`` (heads first).

    Args:
        k_caches: per-layer K caches (a list of L tensors or one ``[L, ...]`` tensor), all of one shape,
            dtype, device and strides, head_dim contiguous.
        v_caches: per-layer V caches, like ``k_caches``.
        block_ids: n engine block ids (list, numpy array or integer tensor on CPU or the caches' device).
        out: a ``[n, 2, L, H, T, D]`` tensor (each block contiguous) or a list of n contiguous
            ``[2, L, H, T, D]`` tensors, of the caches' dtype.
        layout: ``"NHD"`` or ``"HND"``, the axis order of the engine's pages.
        stream: CUDA stream to run on (default: the current one). Ignored on CPU.
        check_ids: check the range of ids given as a CUDA tensor (one device sync). Ids on the host are
            always checked. Unchecked ids out of range are skipped by the kernel, never followed outside
            the caches.

    Returns:
        ``out``. On CUDA the copy is queued on the stream, not finished.

    Raises:
        ValueError: shapes, dtypes or devices disagree, a block id is out of range, or blocks overlap.
    """
    geo, ks, vs, ids, blocks = check_args(k_caches, v_caches, block_ids, out, layout, to_engine=False,
                                      check_ids=check_ids)
    if geo.n:
        if geo.device.type == "cpu":
            cpu_gather(geo, ks, vs, ids, blocks, layout)
        else:
            cuda_run(_plan(geo, ks, vs, blocks), geo.device, ids, to_engine=False, stream=stream)
    return out


def scatter(blocks: torch.Tensor | Sequence[torch.Tensor], k_caches: Sequence[torch.Tensor],
            v_caches: Sequence[torch.Tensor], block_ids: Any, *, layout: EngineLayout = "NHD",
            stream: torch.cuda.Stream | None = None, check_ids: bool = True) -> None:
    """Copy tierkv blocks into engine pages: ``cache[kv][l][block_ids[i]] = blocks[i][kv, l]``.

    Args:
        blocks: a ``[n, 2, L, H, T, D]`` tensor or a list of n contiguous ``[2, L, H, T, D]`` tensors.
        k_caches: per-layer K caches, written in place (see :func:`gather`).
        v_caches: per-layer V caches, written in place.
        block_ids: n distinct engine block ids.
        layout: ``"NHD"`` or ``"HND"``.
        stream: CUDA stream to run on (default: the current one). Ignored on CPU.
        check_ids: check range and uniqueness of ids given as a CUDA tensor (see :func:`gather`); unchecked
            repeats race.

    Raises:
        ValueError: shapes, dtypes or devices disagree, a block id is out of range or repeated.
    """
    geo, ks, vs, ids, src = check_args(k_caches, v_caches, block_ids, blocks, layout, to_engine=True,
                                   check_ids=check_ids)
    if geo.n:
        if geo.device.type == "cpu":
            cpu_scatter(geo, ks, vs, ids, src, layout)
        else:
            cuda_run(_plan(geo, ks, vs, src), geo.device, ids, to_engine=True, stream=stream)


def kernel_plan(k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor], block_ids: Any,
                blocks: torch.Tensor | Sequence[torch.Tensor], *, layout: EngineLayout = "NHD",
                to_engine: bool = False) -> KernelPlan:
    """Launch arguments of the kernel that :func:`gather` (or, with ``to_engine``, :func:`scatter`) runs.

    The arguments are checked as those functions check them. Exposed so tests can run the kernel's host
    build (``-DTIERKV_HOST_EMULATION``) on CPU tensors, which checks the kernel's index math without a GPU.
    """
    geo, ks, vs, _, checked = check_args(k_caches, v_caches, block_ids, blocks, layout, to_engine=to_engine)
    return _plan(geo, ks, vs, checked)


def _plan(geo: Geometry, ks: list[torch.Tensor], vs: list[torch.Tensor],
          blocks: torch.Tensor | list[torch.Tensor]) -> KernelPlan:
    isz = geo.itemsize
    layer_ptrs = tuple(c.data_ptr() for c in ks + vs)
    if isinstance(blocks, torch.Tensor):
        blk_ptrs, blk_base, blk_stride = None, blocks.data_ptr(), blocks.stride(0) * isz
        tier_addrs: tuple[int, ...] = (blk_base, blk_stride)
    else:
        blk_ptrs, blk_base, blk_stride = tuple(b.data_ptr() for b in blocks), 0, 0
        tier_addrs = blk_ptrs
    # The widest word dividing every address and byte stride (a power of two, at least the item size since
    # torch aligns elements); 16 bytes when the caches are aligned.
    word = 16
    for v in (geo.head_dim * isz, geo.s_blk * isz, geo.s_tok * isz, geo.s_head * isz, *layer_ptrs, *tier_addrs):
        word = math.gcd(word, v)
    per = word // isz
    dw = geo.head_dim // per
    bx = min(dw, _THREADS)
    by = max(1, _THREADS // bx)
    rows = geo.heads * geo.tokens
    gy = min(_MAX_GRID_Y, max(1, -(-rows // (by * _UNROLL))))
    gx = geo.n * 2 * geo.num_layers
    if gx >= 2**31:
        raise ValueError(f"too many blocks for one launch ({geo.n} blocks x {geo.num_layers} layers)")
    strides = (geo.s_blk // per, geo.s_tok // per, geo.s_head // per)
    return KernelPlan(word=word, grid=(gx, gy), block=(bx, by), layer_ptrs=layer_ptrs, blk_ptrs=blk_ptrs,
                      blk_base=blk_base, blk_stride=blk_stride, n=geo.n, num_layers=geo.num_layers,
                      heads=geo.heads, tokens=geo.tokens, head_words=dw, s_blk=strides[0], s_tok=strides[1],
                      s_head=strides[2], num_engine_blocks=geo.num_engine_blocks)

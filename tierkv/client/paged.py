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
* On CUDA one kernel launch (``native/paged_kv.cu``) moves all blocks, layers, K and V. It is compiled at
  run time with ``cupy.RawModule`` (NVRTC) when cupy is installed, else with
  ``torch.utils.cpp_extension.load_inline`` (needs nvcc); ``TIERKV_PAGED_BACKEND=cupy|torch`` forces one.
  It runs on ``stream`` (default: the current stream) and returns without waiting. tierkv blocks may live
  on the caches' GPU or in pinned host memory (``pin_memory()`` or ``cudaHostRegister``, as the host
  pool is): the kernel then reads or writes host memory directly over the bus, so synchronise the stream
  before reading gathered host blocks.

Both paths share the argument checks (:func:`_check`); the kernel's launch arguments come from
:func:`kernel_plan`, which the tests also run on CPU tensors against a host build of the same kernel
source, so the index math is checked without a GPU.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from tierkv.core.layout import Layout, dtype_name

EngineLayout = Literal["NHD", "HND"]

__all__ = ["EngineLayout", "KernelPlan", "engine_layout", "gather", "kernel_backend", "kernel_plan", "scatter"]

# Rows per thread per loop trip; must match TKV_UNROLL in native/paged_kv.cu.
_UNROLL = 4
_THREADS = 256
_MAX_GRID_Y = 65535
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, slots=True)
class _Geometry:
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


def engine_layout(k_caches: Sequence[torch.Tensor], *, layout: EngineLayout = "NHD") -> Layout:
    """The tierkv :class:`~tierkv.core.layout.Layout` whose blocks hold pages of these caches.

    Args:
        k_caches: the engine's per-layer K caches.
        layout: ``"NHD"`` (``[blocks, tokens, heads, dim]``) or ``"HND"`` (``[blocks, heads, tokens, dim]``).

    Returns:
        The layout (layers, kv heads, head dim, block tokens, dtype).
    """
    ks = _as_layers(k_caches, "k_caches")
    t, h = _tok_head_dims(layout)
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
    geo, ks, vs, ids, blocks = _check(k_caches, v_caches, block_ids, out, layout, to_engine=False,
                                      check_ids=check_ids)
    if geo.n:
        if geo.device.type == "cpu":
            _cpu_gather(geo, ks, vs, ids, blocks, layout)
        else:
            _cuda_run(geo, ks, vs, ids, blocks, to_engine=False, stream=stream)
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
    geo, ks, vs, ids, src = _check(k_caches, v_caches, block_ids, blocks, layout, to_engine=True,
                                   check_ids=check_ids)
    if geo.n:
        if geo.device.type == "cpu":
            _cpu_scatter(geo, ks, vs, ids, src, layout)
        else:
            _cuda_run(geo, ks, vs, ids, src, to_engine=True, stream=stream)


# ---------------------------------------------------------------------------------------------- checks


def _tok_head_dims(layout: str) -> tuple[int, int]:
    if layout == "NHD":
        return 1, 2
    if layout == "HND":
        return 2, 1
    raise ValueError(f"layout must be 'NHD' or 'HND', got {layout!r}")


def _as_layers(caches: Any, what: str) -> list[torch.Tensor]:
    if isinstance(caches, torch.Tensor):
        if caches.dim() != 5:
            raise ValueError(f"{what} as one tensor must be [layers, blocks, ., ., head_dim], got {tuple(caches.shape)}")
        return list(caches.unbind(0))
    if not isinstance(caches, Sequence) or not caches:
        raise ValueError(f"{what} must be a non-empty list of per-layer tensors")
    if not all(isinstance(c, torch.Tensor) for c in caches):
        raise ValueError(f"{what} must hold torch tensors")
    return list(caches)


def _check(k_caches: Any, v_caches: Any, block_ids: Any, blocks: Any, layout: str, *, to_engine: bool,
           check_ids: bool = True) -> tuple[_Geometry, list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor | list[torch.Tensor]]:
    t_dim, h_dim = _tok_head_dims(layout)
    ks = _as_layers(k_caches, "k_caches")
    vs = _as_layers(v_caches, "v_caches")
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
    geo_args = dict(num_layers=len(ks), heads=int(first.shape[h_dim]), tokens=int(first.shape[t_dim]),
                    head_dim=int(first.shape[3]), num_engine_blocks=num_blocks, dtype=first.dtype,
                    device=device, s_blk=first.stride(0), s_tok=first.stride(t_dim), s_head=first.stride(h_dim))

    ids = _block_ids(block_ids, device)
    n = int(ids.numel())
    geo = _Geometry(n=n, **geo_args)
    if check_ids or ids.device.type == "cpu":  # host ids cost nothing to check
        _check_ids(ids, geo, unique=to_engine)
    checked = _check_blocks(blocks, geo, writes=not to_engine)
    return geo, ks, vs, ids, checked


def _block_ids(block_ids: Any, device: torch.device) -> torch.Tensor:
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


def _check_ids(ids: torch.Tensor, geo: _Geometry, *, unique: bool) -> None:
    if not geo.n:
        return
    host = ids if ids.device.type == "cpu" else ids.cpu()  # one sync when ids live on the GPU
    lo, hi = (int(v) for v in torch.aminmax(host))
    if lo < 0 or hi >= geo.num_engine_blocks:
        raise ValueError(f"block ids must be in [0, {geo.num_engine_blocks}), got range [{lo}, {hi}]")
    if unique and torch.unique(host).numel() != geo.n:
        raise ValueError("block_ids repeat: scattering two blocks into one engine page is ambiguous")


def _blocks_device_ok(t: torch.Tensor, device: torch.device) -> bool:
    if t.device == device:
        return True
    # A CUDA kernel can address pinned (page-locked, registered) host memory directly.
    return device.type == "cuda" and t.device.type == "cpu" and t.is_pinned()


def _check_blocks(blocks: Any, geo: _Geometry, *, writes: bool) -> torch.Tensor | list[torch.Tensor]:
    shape = geo.block_shape
    where = "pinned host memory or " if geo.device.type == "cuda" else ""
    if isinstance(blocks, torch.Tensor):
        if tuple(blocks.shape) != (geo.n, *shape):
            raise ValueError(f"blocks must have shape {(geo.n, *shape)}, got {tuple(blocks.shape)}")
        if blocks.dtype != geo.dtype:
            raise ValueError(f"blocks dtype {blocks.dtype} differs from the caches' {geo.dtype}")
        if not _blocks_device_ok(blocks, geo.device):
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
        if b.device != device and not _blocks_device_ok(b, device):
            raise ValueError(f"block on {b.device} must be in {where}{device}")
        if not b.is_contiguous():
            raise ValueError("each block must be contiguous")
    if writes and len({b.data_ptr() for b in out}) != len(out):
        raise ValueError("two destination blocks share memory")
    return out


# ------------------------------------------------------------------------------------------------ CPU


def _bits(t: torch.Tensor) -> torch.Tensor:
    # Integer views copy bytes exactly (NaN payloads, fp8) and every dtype takes the same kernels.
    return t.view(_BITS[t.element_size()])


def _layer_view(batch: torch.Tensor, kv: int, layer: int, layout: str) -> torch.Tensor:
    """``batch[:, kv, layer]`` ([n, H, T, D]) seen in the engine's axis order."""
    v = batch[:, kv, layer]
    return v.transpose(1, 2) if layout == "NHD" else v


_copy_all = getattr(torch, "_foreach_copy_", None) or (lambda dsts, srcs: [d.copy_(s) for d, s in zip(dsts, srcs)])
# Pages staged per layer when gathering into slots: small enough to stay in cache and to be recycled by the
# allocator without fresh page faults.
_STAGE_BYTES = 4 << 20


def _pages(blocks: list[torch.Tensor], geo: _Geometry, layout: str) -> list[tuple[torch.Tensor, ...]]:
    """Per block, its 2L pages ([H, T, D], seen in the engine's axis order), made in one call per block."""
    flat = [b.view(2 * geo.num_layers, geo.heads, geo.tokens, geo.head_dim).unbind(0) for b in blocks]
    if layout == "NHD":
        flat = [tuple(p.transpose(0, 1) for p in pages) for pages in flat]
    return flat


def _cpu_gather(geo: _Geometry, ks: list[torch.Tensor], vs: list[torch.Tensor], ids: torch.Tensor,
                blocks: torch.Tensor | list[torch.Tensor], layout: str) -> None:
    if isinstance(blocks, torch.Tensor):
        dst = _bits(blocks)
        for kv, caches in enumerate((ks, vs)):
            for layer, cache in enumerate(caches):
                # index_select writes a strided out= in place: one pass, no temporary.
                torch.index_select(_bits(cache), 0, ids, out=_layer_view(dst, kv, layer, layout))
        return
    # Slots are separate tensors: per layer, index_select into a small cache-resident stage in tierkv
    # order, then one batched copy stage -> slots. Faster than copying page by page from the caches, and
    # than staging whole blocks (a big fresh buffer costs page faults).
    page_elems = geo.heads * geo.tokens * geo.head_dim
    group = max(1, _STAGE_BYTES // (page_elems * geo.itemsize))
    dsts = [_bits(b) for b in blocks]
    for g0 in range(0, geo.n, group):
        sub, part = ids[g0:g0 + group], dsts[g0:g0 + group]
        stage = torch.empty((len(part), geo.heads, geo.tokens, geo.head_dim), dtype=dsts[0].dtype)
        stage_in = stage.transpose(1, 2) if layout == "NHD" else stage
        stage_pages = stage.unbind(0)
        slot_pages = [d.view(2 * geo.num_layers, geo.heads, geo.tokens, geo.head_dim).unbind(0) for d in part]
        for r, cache in enumerate(ks + vs):
            torch.index_select(_bits(cache), 0, sub, out=stage_in)
            _copy_all([p[r] for p in slot_pages], stage_pages)


def _cpu_scatter(geo: _Geometry, ks: list[torch.Tensor], vs: list[torch.Tensor], ids: torch.Tensor,
                 blocks: torch.Tensor | list[torch.Tensor], layout: str) -> None:
    # Batched page copies run faster than index_copy_ on CPU (measured, torch 2.13).
    srcs = list(_bits(blocks).unbind(0)) if isinstance(blocks, torch.Tensor) else [_bits(b) for b in blocks]
    pages, idl = _pages(srcs, geo, layout), ids.tolist()
    for r, cache in enumerate(ks + vs):
        c = _bits(cache)
        _copy_all([c.select(0, b) for b in idl], [p[r] for p in pages])


# ----------------------------------------------------------------------------------------- kernel plan


@dataclass(frozen=True, slots=True)
class KernelPlan:
    """Launch arguments of one gather/scatter kernel (see ``native/paged_kv.cu``).

    Addresses are plain integers: device pointers, or host pointers of pinned memory (UVA).
    """

    word: int                 # bytes per copy unit: 16, 8, 4, 2 or 1
    grid: tuple[int, int]
    block: tuple[int, int]
    layer_ptrs: tuple[int, ...]   # 2L addresses: K layers, then V layers
    blk_ptrs: tuple[int, ...] | None  # n tierkv block addresses, or None for blk_base + i * blk_stride
    blk_base: int
    blk_stride: int           # bytes
    n: int
    num_layers: int
    heads: int
    tokens: int
    head_words: int           # head_dim in words
    s_blk: int                # engine strides in words
    s_tok: int
    s_head: int
    num_engine_blocks: int

    def scalar_args(self, to_engine: bool) -> tuple[int, ...]:
        """The kernel arguments after the three array addresses, in order."""
        return (self.blk_base, self.blk_stride, self.n, self.num_layers, self.heads, self.tokens,
                self.head_words, self.s_blk, self.s_tok, self.s_head, self.num_engine_blocks, int(to_engine))


def kernel_plan(k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor], block_ids: Any,
                blocks: torch.Tensor | Sequence[torch.Tensor], *, layout: EngineLayout = "NHD",
                to_engine: bool = False) -> KernelPlan:
    """Launch arguments of the kernel that :func:`gather` (or, with ``to_engine``, :func:`scatter`) runs.

    The arguments are checked as those functions check them. Exposed so tests can run the kernel's host
    build (``-DTIERKV_HOST_EMULATION``) on CPU tensors, which checks the kernel's index math without a GPU.
    """
    geo, ks, vs, _, checked = _check(k_caches, v_caches, block_ids, blocks, layout, to_engine=to_engine)
    return _plan(geo, ks, vs, checked)


def _plan(geo: _Geometry, ks: list[torch.Tensor], vs: list[torch.Tensor],
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


# ----------------------------------------------------------------------------------------------- CUDA


def kernel_source() -> str:
    """Text of ``native/paged_kv.cu`` (``TIERKV_NATIVE_DIR`` overrides where it is looked up)."""
    candidates = [Path(os.environ["TIERKV_NATIVE_DIR"])] if os.environ.get("TIERKV_NATIVE_DIR") else []
    candidates += [Path(__file__).resolve().parent / "native", Path(__file__).resolve().parent.parent / "native"]
    for d in candidates:
        p = d / "paged_kv.cu"
        if p.is_file():
            return p.read_text()
    raise RuntimeError(f"native/paged_kv.cu not found (looked in {[str(c) for c in candidates]})")


class _Launcher:
    """One way to launch the compiled kernel; two exist (cupy, torch extension)."""

    name = "?"

    def launch(self, plan: KernelPlan, arrays: tuple[int, int, int], to_engine: bool, device: int,
               stream: int) -> None:
        raise NotImplementedError


class _CupyLauncher(_Launcher):
    name = "cupy"

    def __init__(self) -> None:
        import cupy  # noqa: F401  (optional extra: tierkv[cuda])

        self._cupy = cupy
        self._module = cupy.RawModule(code=kernel_source(), options=("--std=c++17",))
        self._fns: dict[tuple[int, int], Any] = {}
        # NVRTC compiles lazily; compile now so a failure falls back to the torch extension.
        with cupy.cuda.Device(torch.cuda.current_device()):
            self._module.compile()

    def launch(self, plan: KernelPlan, arrays: tuple[int, int, int], to_engine: bool, device: int,
               stream: int) -> None:
        cp = self._cupy
        with cp.cuda.Device(device):
            fn = self._fns.get((device, plan.word))
            if fn is None:
                fn = self._fns[(device, plan.word)] = self._module.get_function(f"tierkv_paged_copy_{plan.word}")
            args = tuple(np.uint64(a) for a in arrays) + (np.uint64(plan.blk_base),) + tuple(
                np.int64(a) for a in plan.scalar_args(to_engine)[1:])
            with cp.cuda.ExternalStream(stream):
                fn(plan.grid, plan.block, args)


class _TorchExtLauncher(_Launcher):
    name = "torch"

    def __init__(self) -> None:
        from torch.utils.cpp_extension import load_inline

        decl = ("void tierkv_paged_launch(int64_t word, int64_t grid_x, int64_t grid_y, int64_t block_x, "
                "int64_t block_y, int64_t stream, int64_t layer_ptrs_addr, int64_t block_ids_addr, "
                "int64_t blk_ptrs_addr, int64_t blk_base, int64_t blk_stride, int64_t n, int64_t L, int64_t H, "
                "int64_t T, int64_t Dw, int64_t s_blk, int64_t s_tok, int64_t s_head, "
                "int64_t num_engine_blocks, int64_t to_engine);")
        self._mod = load_inline(name="tierkv_paged_kv", cpp_sources=[decl], cuda_sources=[kernel_source()],
                                functions=["tierkv_paged_launch"],
                                extra_cuda_cflags=["-O3", "-DTIERKV_TORCH_EXTENSION"], verbose=False)

    def launch(self, plan: KernelPlan, arrays: tuple[int, int, int], to_engine: bool, device: int,
               stream: int) -> None:
        with torch.cuda.device(device):
            self._mod.tierkv_paged_launch(plan.word, plan.grid[0], plan.grid[1], plan.block[0], plan.block[1],
                                          stream, *arrays, *plan.scalar_args(to_engine))


_launcher: _Launcher | None = None
_launcher_lock = threading.Lock()
_tables: dict[tuple[str, int | None, tuple[int, ...]], torch.Tensor] = {}
_TABLES_MAX = 32


def kernel_backend() -> str:
    """Name of the CUDA kernel backend (``"cupy"`` or ``"torch"``), compiling it on first use.

    Raises:
        RuntimeError: no backend can compile the kernel here.
    """
    return _get_launcher().name


def _get_launcher() -> _Launcher:
    global _launcher
    with _launcher_lock:
        if _launcher is not None:
            return _launcher
        want = os.environ.get("TIERKV_PAGED_BACKEND", "").lower()
        if want not in ("", "cupy", "torch"):
            raise ValueError(f"TIERKV_PAGED_BACKEND must be 'cupy' or 'torch', got {want!r}")
        order = [want] if want else ["cupy", "torch"]
        errors = []
        for name in order:
            try:
                _launcher = _CupyLauncher() if name == "cupy" else _TorchExtLauncher()
                return _launcher
            except Exception as exc:  # noqa: BLE001 - report every backend's reason together
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
        raise RuntimeError("cannot build the paged KV kernel: " + "; ".join(errors))


def _layer_table(device: torch.device, ptrs: tuple[int, ...]) -> torch.Tensor:
    # Engines pass the same caches every step: keep their address tables on the device.
    key = (device.type, device.index, ptrs)
    with _launcher_lock:
        t = _tables.get(key)
        if t is None:
            if len(_tables) >= _TABLES_MAX:
                _tables.pop(next(iter(_tables)))
            t = _tables[key] = torch.tensor(ptrs, dtype=torch.int64).to(device)
    return t


def _cuda_run(geo: _Geometry, ks: list[torch.Tensor], vs: list[torch.Tensor], ids: torch.Tensor,
              blocks: torch.Tensor | list[torch.Tensor], *, to_engine: bool,
              stream: torch.cuda.Stream | None) -> None:
    launcher = _get_launcher()
    plan = _plan(geo, ks, vs, blocks)
    device = geo.device
    s = stream if stream is not None else torch.cuda.current_stream(device)
    # Allocate the small argument arrays on the launch stream so the caching allocator cannot hand their
    # memory to other work before the kernel has read them; mark those made elsewhere as used there.
    with torch.cuda.device(device), torch.cuda.stream(s):
        addrs, arrays = _arg_arrays(plan, ids, device)
        for t in arrays:
            if t.device.type == "cuda":
                t.record_stream(s)
        launcher.launch(plan, addrs, to_engine, device.index or 0, s.cuda_stream)


def _arg_arrays(plan: KernelPlan, ids: torch.Tensor, device: torch.device
                ) -> tuple[tuple[int, int, int], list[torch.Tensor]]:
    """Addresses of the kernel's three arrays (layer table, block ids, tierkv block addresses) on ``device``,
    and the tensors holding them (to keep alive until the launch is queued)."""
    table = _layer_table(device, plan.layer_ptrs)
    if ids.device.type == "cpu":
        # Ids and block addresses travel together: one small host-to-device copy.
        host = ids if plan.blk_ptrs is None else torch.cat([ids, torch.tensor(plan.blk_ptrs, dtype=torch.int64)])
        dev = host.to(device, non_blocking=True)
        ptrs_addr = 0 if plan.blk_ptrs is None else dev[plan.n:].data_ptr()
        return (table.data_ptr(), dev.data_ptr(), ptrs_addr), [table, dev]
    if plan.blk_ptrs is None:
        return (table.data_ptr(), ids.data_ptr(), 0), [table, ids]
    ptrs = torch.tensor(plan.blk_ptrs, dtype=torch.int64).to(device, non_blocking=True)
    return (table.data_ptr(), ids.data_ptr(), ptrs.data_ptr()), [table, ids, ptrs]

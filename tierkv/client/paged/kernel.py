"""The CUDA path: the kernel's launch plan, its compilation (cupy or a torch extension) and its launch."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class KernelPlan:
    """Launch arguments of one gather/scatter kernel (see ``tierkv/_native/paged_kv.cu``).

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


# GPU architectures the kernel is built for (NVRTC compiles it for the one present at first use); `make
# test` compiles it for each with nvcc: Turing, Ampere, Ada, Hopper, Blackwell.
CUDA_ARCHS = ("75", "80", "86", "89", "90", "100", "120")


def kernel_source() -> str:
    """Text of ``tierkv/_native/paged_kv.cu``, package data (``TIERKV_NATIVE_DIR`` names another folder)."""
    if os.environ.get("TIERKV_NATIVE_DIR"):
        p = Path(os.environ["TIERKV_NATIVE_DIR"]) / "paged_kv.cu"
        if p.is_file():
            return p.read_text()
        raise RuntimeError(f"paged_kv.cu not found in TIERKV_NATIVE_DIR ({p.parent})")
    return resources.files("tierkv._native").joinpath("paged_kv.cu").read_text()


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


def cuda_run(plan: KernelPlan, device: torch.device, ids: torch.Tensor, *, to_engine: bool,
             stream: torch.cuda.Stream | None) -> None:
    """Queue the kernel of ``plan`` on ``stream`` (default: the current stream of ``device``)."""
    launcher = _get_launcher()
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

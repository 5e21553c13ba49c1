"""The few CUDA runtime calls torch does not expose: raw device allocations, IPC handles and host
registration, through ctypes on the libcudart that torch already loaded.

Why not torch's allocator: a CUDA IPC handle names the base of a ``cudaMalloc`` allocation, and torch's
caching allocator carves tensors out of larger segments (the offset and its ref-counting files are what
``torch.multiprocessing`` shares). A pool from one ``cudaMalloc`` of its own has a handle that is simply
the pool: clients open it and index slots by offset. Nothing here runs without CUDA; callers check
:func:`available` first.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from typing import Any

IPC_HANDLE_BYTES = 64
_LAZY_PEER_ACCESS = 1       # cudaIpcMemLazyEnablePeerAccess
_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context of the process


class CudaError(RuntimeError):
    """A CUDA runtime call failed."""


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


_lib: ctypes.CDLL | None = None
_lock = threading.Lock()


def available() -> bool:
    """Whether torch sees a CUDA device (tierkv's GPU paths need torch's CUDA build)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _cudart() -> ctypes.CDLL:
    """The libcudart torch loaded (found in this process's mappings), else one next to torch."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        import torch

        torch.cuda.init()
        paths: list[str] = []
        try:
            with open("/proc/self/maps") as f:
                paths = sorted({line.split()[-1] for line in f if "libcudart.so" in line})
        except OSError:
            pass
        if not paths:
            site = os.path.dirname(os.path.dirname(torch.__file__))
            paths = sorted(glob.glob(os.path.join(site, "nvidia", "**", "libcudart.so*"), recursive=True))
        paths += ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
        for path in paths:
            try:
                lib = ctypes.CDLL(path)
                _declare(lib)
                _lib = lib
                return lib
            except OSError:
                continue
        raise CudaError("libcudart not found (tierkv's GPU tier needs torch's CUDA build)")


def _declare(lib: ctypes.CDLL) -> None:
    """Argument types, so ctypes passes sizes as size_t and the IPC handle struct by value."""
    vp, sz, u = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
    sigs = {
        "cudaMalloc": [ctypes.POINTER(vp), sz],
        "cudaFree": [vp],
        "cudaIpcGetMemHandle": [ctypes.POINTER(_IpcHandle), vp],
        "cudaIpcOpenMemHandle": [ctypes.POINTER(vp), _IpcHandle, u],
        "cudaIpcCloseMemHandle": [vp],
        "cudaHostRegister": [vp, sz, u],
        "cudaHostUnregister": [vp],
        "cudaGetErrorString": [ctypes.c_int],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    lib.cudaGetErrorString.restype = ctypes.c_char_p


def _check(rc: int, what: str) -> None:
    if rc != 0:
        msg = _cudart().cudaGetErrorString(rc)
        raise CudaError(f"{what} failed: {msg.decode() if msg else rc}")


def _set_device(device: int) -> None:
    import torch

    torch.cuda.set_device(device)  # the runtime calls below act on the current device


def malloc(nbytes: int, device: int) -> int:
    """``cudaMalloc`` on ``device``; returns the device pointer."""
    _set_device(device)
    ptr = ctypes.c_void_p()
    _check(_cudart().cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), f"cudaMalloc({nbytes})")
    return int(ptr.value or 0)


def free(ptr: int, device: int) -> None:
    """``cudaFree``."""
    _set_device(device)
    _check(_cudart().cudaFree(ctypes.c_void_p(ptr)), "cudaFree")


def ipc_handle(ptr: int, device: int) -> bytes:
    """The 64-byte IPC handle of an allocation made by :func:`malloc`."""
    _set_device(device)
    h = _IpcHandle()
    _check(_cudart().cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(ptr)), "cudaIpcGetMemHandle")
    return bytes(h.reserved)


def ipc_open(handle: bytes, device: int) -> int:
    """Map another process's allocation; returns the pointer in this process."""
    if len(handle) != IPC_HANDLE_BYTES:
        raise CudaError(f"an IPC handle is {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
    _set_device(device)
    h = _IpcHandle()
    ctypes.memmove(ctypes.byref(h), handle, IPC_HANDLE_BYTES)
    ptr = ctypes.c_void_p()
    _check(_cudart().cudaIpcOpenMemHandle(ctypes.byref(ptr), h, ctypes.c_uint(_LAZY_PEER_ACCESS)),
           "cudaIpcOpenMemHandle")
    return int(ptr.value or 0)


def ipc_close(ptr: int, device: int) -> None:
    """Unmap what :func:`ipc_open` mapped."""
    _set_device(device)
    _check(_cudart().cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")


def host_register(ptr: int, nbytes: int) -> None:
    """Pin an existing host mapping (the host pool's memfd) for DMA: ``cudaHostRegister``."""
    _check(_cudart().cudaHostRegister(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes),
                                      ctypes.c_uint(_HOST_REGISTER_PORTABLE)), "cudaHostRegister")


def host_unregister(ptr: int) -> None:
    """Undo :func:`host_register`."""
    _check(_cudart().cudaHostUnregister(ctypes.c_void_p(ptr)), "cudaHostUnregister")


def is_pinned(ptr: int) -> bool:
    """Whether ``ptr`` is registered (page-locked) host memory, asked of the driver."""
    import torch

    t = torch.from_numpy(_np_view(ptr))
    return bool(t.is_pinned())


def _np_view(ptr: int) -> Any:
    import numpy as np

    return np.ctypeslib.as_array((ctypes.c_uint8 * 1).from_address(ptr))


class _DeviceMemory:
    """An object with ``__cuda_array_interface__`` so torch can view raw device memory without a copy."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 2}


def device_tensor(ptr: int, nbytes: int, device: int) -> Any:
    """A flat uint8 torch tensor over ``nbytes`` of device memory at ``ptr`` (not owned: the caller
    frees the memory after the last view is gone)."""
    import torch

    return torch.as_tensor(_DeviceMemory(ptr, nbytes), device=f"cuda:{device}")

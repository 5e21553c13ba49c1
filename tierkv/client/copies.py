"""Host copies of whole blocks between a caller's tensors and pool slots, and fresh batch tensors.

Slots are written once and read later by another process, so copies into them use streaming stores
(``tierkv._native._ntcopy``): glibc's memcpy reads a 2 MiB destination into the cache before writing it. A
large batch is split across as many threads as torch uses (the copy releases the GIL), so a put keeps
up with torch's own multi-threaded ``copy_`` of the same bytes.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from tierkv.core.layout import Layout

_stream_copy: Callable[[np.ndarray, np.ndarray], None]
try:  # streaming-store copy (tierkv/_native/ntcopy.c)
    from tierkv._native._ntcopy import copy as _stream_copy
except ImportError:  # pragma: no cover - the extension is optional
    def _stream_copy(dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

# Below this many bytes per thread a thread's start-up costs more than its share of the copy.
PER_THREAD_BYTES = 8 << 20
# Fresh batches at least this large are backed by transparent huge pages (see new_batch).
HUGE_BYTES = 4 << 20

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """uint8 numpy view of a contiguous CPU tensor's bytes (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def copy_pairs(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """Copy each ``(dst, src)`` pair of equal-sized uint8 arrays, in parallel when the batch is large."""
    if not pairs:
        return
    nbytes = sum(int(src.nbytes) for _, src in pairs)
    parts = max(1, min(torch.get_num_threads(), len(pairs), nbytes // PER_THREAD_BYTES))
    if parts == 1:
        _copy_run(pairs)
        return
    step = -(-len(pairs) // parts)
    runs = [pairs[lo:lo + step] for lo in range(0, len(pairs), step)]
    futures = [_executor().submit(_copy_run, run) for run in runs[1:]]
    try:
        _copy_run(runs[0])
    finally:
        for f in futures:
            f.result()  # every worker is done with the buffers before they can be released


def _copy_run(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in pairs:
        _stream_copy(dst, src)


def _executor() -> ThreadPoolExecutor:
    global _pool, _pool_pid
    with _pool_lock:
        # A forked child inherits the executor but not its threads: it makes its own.
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(max(1, torch.get_num_threads() - 1), thread_name_prefix="tierkv-copy")
            _pool_pid = os.getpid()
        return _pool


def new_batch(layout: Layout, n: int) -> torch.Tensor:
    """An uninitialised CPU tensor of ``n`` blocks, ``[n, 2, layers, kv_heads, block_tokens, head_dim]``.

    A large batch is backed by its own anonymous mapping with transparent huge pages: a fresh 64 MiB
    tensor from the default allocator takes 16,384 page faults on first touch, which cost more than
    the copy that fills it. The mapping lives as long as the tensor does.
    """
    shape = layout.batch_shape(n)
    nbytes = n * layout.block_bytes
    if nbytes < HUGE_BYTES:
        return torch.empty(shape, dtype=layout.torch_dtype)
    mm = mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: plain pages
            pass
    return torch.frombuffer(mm, dtype=torch.uint8).view(layout.torch_dtype).view(shape)

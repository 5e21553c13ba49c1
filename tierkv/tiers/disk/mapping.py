"""The process's mappings of the LMDB data file: read ahead, map in, drop from the process.

LMDB maps the file with MADV_RANDOM, and the disk tier keeps its own read-only mapping of it; both are
madvised here through libc (Python's mmap has no madvise on a raw address).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

PAGE = 4096
MADV_WILLNEED = 3
MADV_DONTNEED = 4
MADV_POPULATE_READ = 22  # Linux 5.14+: fault a whole range in at once
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


def willneed(value: memoryview) -> None:
    """Read and map a whole value before decoding it. LMDB maps with MADV_RANDOM, so touching a 2 MiB
    value page by page takes ~500 page faults, each a 4 KiB read when the page is not cached. One
    MADV_WILLNEED starts the reads of the whole range at once (large I/Os; measured: 0.1 vs 1.3 GB/s from
    the device), then one MADV_POPULATE_READ (Linux 5.14+) maps it (measured: 0.4 vs 2.4 GB/s from the
    page cache)."""
    if len(value) < 64 << 10:
        return
    addr = np.frombuffer(value, np.uint8).ctypes.data
    start = addr & ~(PAGE - 1)
    length = addr + len(value) - start
    libc.madvise(start, length, MADV_WILLNEED)
    libc.madvise(start, length, MADV_POPULATE_READ)


def find_mapping(path: Path, size: int) -> int | None:
    """The address of this process's mapping of ``path`` that is ``size`` bytes long (LMDB maps its
    whole map size; py-lmdb does not say where), or None."""
    target = os.path.realpath(path)
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].strip() == target:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    if hi - lo == size:
                        return lo
    except OSError:
        pass
    return None


def unmap_pages(value: memoryview) -> None:
    """Take the pages wholly inside ``value`` out of this process's mappings (MADV_DONTNEED on a shared
    read-only file mapping: the page cache keeps them, the next use maps them again)."""
    if len(value) < 64 << 10:
        return
    addr = np.frombuffer(value, np.uint8).ctypes.data
    start = (addr + PAGE - 1) & ~(PAGE - 1)
    end = (addr + len(value)) & ~(PAGE - 1)
    if end > start:
        libc.madvise(start, end - start, MADV_DONTNEED)


def resident(view: memoryview, off: int, size: int) -> bool:
    """Whether every page of ``view[off:off + size]`` is in the page cache (mincore)."""
    addr = np.frombuffer(view, np.uint8, size, off).ctypes.data
    start = addr & ~(PAGE - 1)
    length = addr + size - start
    vec = np.empty((length + PAGE - 1) // PAGE, np.uint8)
    if libc.mincore(start, length, vec.ctypes.data) != 0:
        return False
    return bool((vec & 1).all())

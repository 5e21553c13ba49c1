"""The daemon's glibc allocator settings: the tunables it runs under and a periodic ``malloc_trim``."""

from __future__ import annotations

import ctypes
import os
import threading
import time

# glibc returns large freed blocks to the OS at once, so every 2 MiB buffer LMDB mallocs for a value is
# a fresh mmap that page-faults while being filled (measured: LMDB puts 1.8 -> 8.7 GB/s with these).
# Non-temporal copies from 1 MiB up keep 2 MiB copies at bulk memcpy speed.
#
# The price of that trim threshold: glibc gives no freed heap memory back on its own. With the default
# of 8 x cores malloc arenas (16 here), each connection thread lands on one; under client churn every
# arena kept its own free holes and its own free top chunk, and the soak's anonymous RSS crept up
# ~50 MB/h while glibc's bytes in use stayed flat at ~18 MB (docs/design.md). So: one arena
# (the threads mostly run under the GIL anyway), and malloc_trim(0) every MALLOC_TRIM_S seconds, which
# returns the free pages of the heap, holes and top alike, to the kernel (1-7 ms a call in the soak).
# malloc_trim cannot shrink a thread arena's top chunk; that is why the arena count matters.
TUNABLES = ("glibc.malloc.mmap_threshold=67108864:glibc.malloc.trim_threshold=268435456:"
              "glibc.malloc.arena_max=1:glibc.cpu.x86_non_temporal_threshold=0x100000")
MALLOC_TRIM_S = 10.0
TRIM_STATS = {"count": 0, "last_s": 0.0, "max_s": 0.0}  # read by tierkv.daemon.memdebug's samples


def malloc_trim() -> bool:
    """Give free heap pages of every glibc arena back to the kernel; False where there is no glibc."""
    try:
        fn = ctypes.CDLL(None).malloc_trim  # ctypes releases the GIL for the call
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_size_t]
    fn(0)
    return True


def start_malloc_trim(interval: float = MALLOC_TRIM_S) -> threading.Thread | None:
    """Call :func:`malloc_trim` every ``interval`` seconds on a daemon thread (``interval <= 0``: never).

    ``TIERKV_MALLOC_TRIM_S`` overrides the interval (0 turns it off)."""
    interval = float(os.environ.get("TIERKV_MALLOC_TRIM_S", interval))
    if interval <= 0 or not malloc_trim():
        return None

    def loop() -> None:
        while True:
            time.sleep(interval)
            t0 = time.perf_counter()
            malloc_trim()
            took = time.perf_counter() - t0
            TRIM_STATS.update(count=TRIM_STATS["count"] + 1, last_s=took, max_s=max(TRIM_STATS["max_s"], took))

    t = threading.Thread(target=loop, name="tierkv-malloc-trim", daemon=True)
    t.start()
    return t

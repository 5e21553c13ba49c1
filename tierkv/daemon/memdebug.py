"""Memory diagnostics for the daemon, off by default (``TIERKV_MEMDEBUG=PATH``).

When ``TIERKV_MEMDEBUG`` names a file, ``tierkv serve`` starts a thread that appends one JSON line
every ``TIERKV_MEMDEBUG_S`` seconds (default 10): the process's anonymous RSS split by mapping
(``[heap]``, other anonymous mappings), glibc's allocator totals (``mallinfo2``: bytes in use, free but
kept, mmapped), the number of malloc arenas, Python's allocated blocks and object counts, and the sizes
of the daemon's own structures (block records, policy entries, history, connections, threads, LMDB). With
``TIERKV_MEMDEBUG_TRACE=1`` it also runs tracemalloc and writes the top growth by line between samples
(slow: for finding a Python-level leak, not for figures). It tells Python heap growth from
allocator retention in the soak (docs/design.md).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable

from tierkv.daemon.malloc import TRIM_STATS


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def mallinfo() -> dict[str, int]:
    """glibc's allocator totals over all arenas (empty where mallinfo2 is missing)."""
    try:
        libc = ctypes.CDLL(None)
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return {}
    fn.restype = _MallInfo2
    m = fn()
    return {"arena": m.arena, "mmapped": m.hblkhd, "in_use": m.uordblks, "free": m.fordblks,
            "top_keep": m.keepcost}


def malloc_arenas() -> dict[str, int]:
    """How many malloc arenas exist and the free bytes in their bins (from ``malloc_info``'s XML); the
    rest of ``mallinfo``'s free bytes is the arenas' top chunks, which only the main arena trims."""
    try:
        libc = ctypes.CDLL(None)
        buf, size = ctypes.c_char_p(), ctypes.c_size_t()
        libc.open_memstream.restype = ctypes.c_void_p
        f = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
        libc.malloc_info(0, ctypes.c_void_p(f))
        libc.fclose(ctypes.c_void_p(f))
        text = ctypes.string_at(buf, size.value).decode()
        libc.free(buf)
        tail = text[text.rindex("</heap>"):]
        binned = sum(int(m) for m in re.findall(r'<total type="(?:fast|rest)" count="\d+" size="(\d+)"', tail))
        return {"arenas": text.count("<heap nr="), "bins_free": binned}
    except (OSError, AttributeError, ValueError):
        return {}


def anon_maps() -> dict[str, int]:
    """Anonymous RSS in kB: the main heap, thread-arena heaps and stacks (other anonymous mappings)."""
    out = {"heap_kb": 0, "other_anon_kb": 0, "anon_kb": 0}
    name = ""
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=6)
            if "-" in first[0] and len(first) >= 5 and not first[0].endswith(":"):
                name = first[5].strip() if len(first) > 5 else ""
            elif first[0] == "Anonymous:":
                kb = int(first[1])
                out["anon_kb"] += kb
                out["heap_kb" if name == "[heap]" else "other_anon_kb"] += kb
    return out


def start(sizes: Callable[[], dict[str, int]]) -> None:
    """Start the sampler if ``TIERKV_MEMDEBUG`` is set; otherwise do nothing. ``sizes()``: the daemon's
    own structures (:meth:`tierkv.daemon.server.Server.memory_figures`)."""
    path = os.environ.get("TIERKV_MEMDEBUG")
    if not path:
        return
    every = float(os.environ.get("TIERKV_MEMDEBUG_S", "10"))
    trace = os.environ.get("TIERKV_MEMDEBUG_TRACE") == "1"
    if trace:
        import tracemalloc

        tracemalloc.start(4)

    def loop() -> None:
        t0 = time.time()
        prev = None
        while True:
            time.sleep(every)
            row: dict[str, object] = {"t": round(time.time() - t0, 1), **anon_maps(), **mallinfo(),
                                   **malloc_arenas(), "py_blocks": sys.getallocatedblocks(),
                                   "gc_objects": len(gc.get_objects())}
            row.update({f"trim_{k}": v for k, v in TRIM_STATS.items()})
            row.update(sizes())
            if trace:
                import tracemalloc

                snap = tracemalloc.take_snapshot().filter_traces(
                    [tracemalloc.Filter(False, tracemalloc.__file__)])
                row["traced_kb"] = tracemalloc.get_traced_memory()[0] // 1024
                if prev is not None:
                    row["top"] = [f"{s.size_diff // 1024:+d} kB {s.count_diff:+d} "
                                  f"{s.traceback[0].filename}:{s.traceback[0].lineno}"
                                  for s in snap.compare_to(prev, "lineno")[:12]]
                prev = snap
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")

    threading.Thread(target=loop, name="tierkv-memdebug", daemon=True).start()

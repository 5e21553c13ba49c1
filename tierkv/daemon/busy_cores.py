"""How many cores other processes (the inference engine) kept busy lately, from the CPU counters (psutil).

Write-behind (host blocks written ahead of eviction, which nothing waits for) costs CPU that the
engine's steps need on a small machine: the disk writer's copies into the page cache run in the kernel,
where a waking engine thread waits for them whatever the writer's priority. The evictor starts a
write-behind batch only while the engine leaves cores idle (``host.write_behind_idle_cores``).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import deque
from collections.abc import Callable

import psutil

__all__ = ["BusyCores"]

READ_EVERY_S = 0.1  # readings closer together than this are not kept


def _busy_seconds(me: psutil.Process) -> tuple[float, float] | None:
    """(seconds any CPU was busy, seconds ``me`` ran), or None where the counters are not readable."""
    try:
        cpu, own = psutil.cpu_times(), me.cpu_times()
    except (psutil.Error, OSError):
        return None
    idle = cpu.idle + getattr(cpu, "iowait", 0.0)
    busy = sum(cpu) - idle - getattr(cpu, "guest", 0.0) - getattr(cpu, "guest_nice", 0.0)  # guests: in user
    return busy, own.user + own.system


class BusyCores:
    """Cores busy with other processes than this one, averaged over the last ``window`` seconds.

    Args:
        window: the span averaged over (at least ``READ_EVERY_S``).
        read: the counters (seconds busy on any CPU, seconds this process ran); the default asks psutil.
        clock: seconds, monotonic.
    """

    def __init__(self, window: float = 0.5, read: Callable[[], tuple[float, float] | None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window = max(READ_EVERY_S, window)
        self._read = read or functools.partial(_busy_seconds, psutil.Process())
        self._clock = clock
        self._readings: deque[tuple[float, float, float]] = deque()
        self._lock = threading.Lock()  # the evictor and the movers' threads read it
        self.others()  # the first reading: the base of the next

    def others(self) -> float | None:
        """Cores other processes used on average over about the last ``window`` seconds (None: not
        known yet, or not on Linux)."""
        with self._lock:
            return self._others()

    def _others(self) -> float | None:
        now = self._clock()
        got = self._read()
        if got is None:
            return None
        r = self._readings
        if not r or now - r[-1][0] >= READ_EVERY_S:
            r.append((now, *got))
        while len(r) > 1 and now - r[1][0] >= self.window:
            r.popleft()  # keep the newest reading at least ``window`` old as the base
        t0, busy0, own0 = r[0]
        if now - t0 < READ_EVERY_S:
            return None
        return max(0.0, (got[0] - busy0) - (got[1] - own0)) / (now - t0)

    def idle(self, cores: float) -> bool:
        """Whether other processes left at least ``cores`` of this machine's cores idle lately (True
        while that is not known)."""
        others = self.others()
        return others is None or (os.cpu_count() or 1) - others >= cores

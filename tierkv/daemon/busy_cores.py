"""How many cores other processes (the inference engine) kept busy lately, from Linux's CPU counters.

Write-behind (host blocks written ahead of eviction, which nothing waits for) costs CPU that the
engine's steps need on a small machine: the disk writer's copies into the page cache run in the kernel,
where a waking engine thread waits for them whatever the writer's priority. The evictor starts a
write-behind batch only while the engine leaves cores idle (``host.write_behind_idle_cores``).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable

__all__ = ["BusyCores"]

READ_EVERY_S = 0.1  # readings closer together than this are not kept


def _busy_ticks() -> tuple[int, int] | None:
    """(ticks any CPU was busy, ticks this process ran), or None where the counters are not readable."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat", "rb") as f:
            own = f.read()
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice, already counted in user and nice]
    busy = sum(fields[:8]) - fields[3] - (fields[4] if len(fields) > 4 else 0)
    rest = own[own.rindex(b")") + 2:].split()
    return busy, int(rest[11]) + int(rest[12])  # utime + stime


class BusyCores:
    """Cores busy with other processes than this one, averaged over the last ``window`` seconds.

    Args:
        window: the span averaged over (at least ``READ_EVERY_S``).
        read: the counters (ticks busy on any CPU, ticks of this process); the default reads Linux's.
        clock: seconds, monotonic.
    """

    def __init__(self, window: float = 0.5, read: Callable[[], tuple[int, int] | None] = _busy_ticks,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window = max(READ_EVERY_S, window)
        self._read, self._clock = read, clock
        self._tick = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
        self._readings: deque[tuple[float, int, int]] = deque()
        self.others()  # the first reading: the base of the next

    def others(self) -> float | None:
        """Cores other processes used on average over about the last ``window`` seconds (None: not
        known yet, or not on Linux)."""
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
        return max(0.0, (got[0] - busy0) - (got[1] - own0)) / self._tick / (now - t0)

    def idle(self, cores: float) -> bool:
        """Whether other processes left at least ``cores`` of this machine's cores idle lately (True
        while that is not known)."""
        others = self.others()
        return others is None or (os.cpu_count() or 1) - others >= cores

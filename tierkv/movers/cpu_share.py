"""A share of the cores for disk work no request waits for, while the engine keeps the cores busy.

Demotions and write-behind (encodes and disk writes of blocks leaving, or about to leave, host memory)
run on low-priority threads, yet on a small machine they still take the moments between the engine's
steps, and a step that wakes finds its cores taken. The share bounds them: while the engine keeps the
cores busy (the daemon's measure of the other processes' load), such work gets at most ``share`` cores'
worth of CPU time, charged per task from the thread's own CPU clock to a token bucket; once the engine
leaves cores idle it catches up at full speed. A durable put, a load and the shutdown flush are never
held back, and held-back work gives way at once when one of them queues behind it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["CpuShare"]

BURST_S = 0.05  # CPU seconds the bucket holds when full: one block's encode runs without a pause
PAUSE_S = 0.01  # longest sleep between two looks at the bucket, the engine's load and the queue
MIN_PAUSE_S = 0.0005  # shortest: a deficit of a rounding error still ends


class CpuShare:
    """A token bucket of CPU seconds, filled at ``share`` cores while ``busy()`` says the engine keeps the
    cores busy (full, and not charged against, otherwise).

    Args:
        share: cores the bounded work may use while the engine is busy (0: no bound).
        busy: whether the engine keeps the cores busy now.
        clock: seconds, monotonic; sleep: waits that many seconds.
    """

    def __init__(self, share: float, busy: Callable[[], bool], clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.share = share
        self._busy, self._clock, self._sleep = busy, clock, sleep
        self._lock = threading.Lock()
        self._tokens = BURST_S
        self._t = clock()
        self.used_s = 0.0    # CPU seconds charged while the engine was busy
        self.waited_s = 0.0  # seconds bounded work waited for its turn

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(BURST_S, self._tokens + (now - self._t) * self.share)
        self._t = now

    def charge(self, cpu_s: float) -> None:
        """Bounded work used ``cpu_s`` seconds of CPU (counted only while the engine is busy)."""
        if self.share <= 0 or not self._busy():
            return
        with self._lock:
            self._refill()
            self._tokens -= cpu_s
            self.used_s += cpu_s

    def wait_turn(self, give_way: Callable[[], bool] | None = None) -> None:
        """Wait while the bucket is empty and the engine busy; return at once when ``give_way()`` says work
        that must not wait queued behind (a durable put, the flush)."""
        while self.share > 0:
            with self._lock:
                self._refill()
                deficit = -self._tokens
            if deficit <= 0 or not self._busy() or (give_way is not None and give_way()):
                return
            pause = min(PAUSE_S, max(MIN_PAUSE_S, deficit / self.share))
            self._sleep(pause)
            self.waited_s += pause

    def timed(self, fn: Callable[[], object], give_way: Callable[[], bool] | None = None) -> object:
        """``fn()`` as bounded work: after its turn, charged its thread's CPU time."""
        self.wait_turn(give_way)
        t0 = time.thread_time()
        try:
            return fn()
        finally:
            self.charge(time.thread_time() - t0)

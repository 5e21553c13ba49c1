"""What every path of the block store shares: one lock, the condition its waiters wait on, the running
settings, the decisions' clock, the closing flag, the health reason and the evictor's wake-up. Waits on the condition are woken
by ``notify`` whenever blocks become free, clean or settled; a wait ends at its deadline or when the
store closes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from tierkv.cache.clock import DrivenClock
from tierkv.daemon.config import Config


class Context:
    """The store's lock and condition, its settings, its lifecycle flags and the evictor's wake-up."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.closing = False
        self.degraded = ""  # why the store is degraded ("" when healthy)
        self.wakeup = threading.Event()  # runs the evictor soon: set by kick and by every disk write that settles
        self.force = False  # the next evictor pass demotes at least a slab, even below the high watermark
        # what the policies, reuse models and admission rule read as now: a client moves it under
        # ``server.synchronous``, where a store that kicks the evictor waits for the pass it asked for
        self.synchronous = cfg.server.synchronous
        self.clock: Callable[[], float] = DrivenClock() if self.synchronous else time.monotonic
        self.kicks = 0  # evictor passes asked for
        self.passes = 0  # of those, the ones the evictor has done (its last pass started after them)
        self._asks = threading.Lock()  # kicks come from mover threads too, without the store's lock

    def notify(self) -> None:
        """Wake every waiter (a block became free, clean or settled). Lock held."""
        self.changed.notify_all()

    def kick(self, force: bool = False) -> None:
        """Ask the evictor to run soon; ``force``: demote even below the high watermark."""
        with self._asks:
            self.force = force or self.force
            self.kicks += 1
        self.wakeup.set()

    def take_kicks(self) -> tuple[bool, int]:
        """For the evictor's pass: whether a kick asked to force it (cleared), and how many kicks came so far."""
        with self._asks:
            force, self.force = self.force, False
            return force, self.kicks

    def wait_until(self, deadline: float) -> bool:
        """Wait on the condition until notified or ``deadline`` (monotonic seconds); False once the
        deadline has passed or the store is closing. Lock held."""
        left = deadline - time.monotonic()
        if left <= 0 or self.closing:
            return False
        self.changed.wait(left)
        return not self.closing

    def wait_for_pass(self, deadline: float) -> None:
        """Wait until the evictor has done a pass that started after the last :meth:`kick` (its
        demotion's writes settled), or the deadline. Lock held."""
        asked = self.kicks
        while self.passes < asked and self.wait_until(deadline):
            pass

    def close(self) -> None:
        """Mark the store closing and wake every waiter (their waits end)."""
        with self.lock:
            self.closing = True
            self.changed.notify_all()
        self.wakeup.set()

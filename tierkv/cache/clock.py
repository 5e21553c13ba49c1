"""The clock the cache's decisions read: the monotonic clock, or one its driver sets.

``tierkv replay`` moves a :class:`DrivenClock` to each request's trace time; a daemon started with
``server.synchronous`` runs its policies, reuse models and admission rule on one that a client
sets before each request (:meth:`tierkv.client.Client.set_clock`), so a trace fed to a running daemon
is decided on the trace's clock, as replay decides it. Deadlines and waits stay on the monotonic clock.
"""

from __future__ import annotations

__all__ = ["DrivenClock"]


class DrivenClock:
    """A clock that stands still until :meth:`set` moves it (seconds, never backwards)."""

    __slots__ = ("now",)

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def set(self, now: object) -> None:
        """Move the clock to ``now``.

        Raises:
            ValueError: ``now`` is not a finite number at or after the clock's time.
        """
        if not isinstance(now, (int, float)) or isinstance(now, bool) or not now - now == 0:
            raise ValueError(f"a clock time must be a finite number of seconds, got {now!r}")
        if now < self.now:
            raise ValueError(f"the clock does not go back: {now} is before {self.now}")
        self.now = float(now)

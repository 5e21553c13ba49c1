"""The engine's prefill speed as the scheduler sees it, for the daemon's cost model."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["PrefillMeter"]


class PrefillMeter:
    """The engine's prefill speed, seen from the scheduler: tokens of each step over the time to the next
    step, for steps whose requests carry on into the next (no idle gap), reported to the daemon's cost
    model every ``every_s`` seconds.

    Args:
        report: called with (tokens, seconds) summed since the last report.
        min_tokens: steps with fewer scheduled tokens (decode steps) are left out.
        every_s: seconds between reports.
        clock: time source.
    """

    def __init__(self, report: Callable[[int, float], object], min_tokens: int = 256, every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.report, self.min_tokens, self.every_s, self.clock = report, min_tokens, every_s, clock
        self._last: tuple[float, int, set[str]] | None = None
        self._tokens, self._seconds = 0, 0.0
        self._all_tokens, self._all_seconds = 0, 0.0
        self._next = clock() + every_s

    def tokens_per_s(self) -> float | None:
        """Prefill tokens/s over every step measured so far, reported or not (None: none yet)."""
        return self._all_tokens / self._all_seconds if self._all_seconds > 0 else None

    def step(self, scheduled: dict[str, int]) -> None:
        """One step was scheduled with ``scheduled`` tokens per request id."""
        now = self.clock()
        last = self._last
        if last is not None and last[1] >= self.min_tokens and last[2] & scheduled.keys():
            self._tokens += last[1]
            self._seconds += now - last[0]
            self._all_tokens += last[1]
            self._all_seconds += now - last[0]
        self._last = (now, sum(scheduled.values()), set(scheduled))
        if now >= self._next and self._tokens and self._seconds > 0:
            tokens, seconds = self._tokens, self._seconds
            self._tokens, self._seconds = 0, 0.0
            self._next = now + self.every_s
            self.report(tokens, seconds)

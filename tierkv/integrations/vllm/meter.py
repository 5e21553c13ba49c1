"""The engine's prefill speed as the scheduler sees it, for the daemon's cost model, and the bound it
sets on an asynchronous load."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["ASYNC_WAIT_MAX_S", "ASYNC_WAIT_MIN_S", "PrefillMeter", "wait_bound"]

ASYNC_WAIT_MIN_S = 0.5   # the least an asynchronous load may take (a disk read of a few blocks)
ASYNC_WAIT_MAX_S = 30.0  # the most, whatever the cost model says


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


def wait_bound(plan: dict[str, Any], n: int, block_tokens: int, tokens_per_s: float | None = None) -> float:
    """How long an asynchronous load of the first ``n`` blocks may take: the seconds recomputing them
    would cost, within the fixed floor and ceiling. The daemon's cost model gives them; where it knows no
    prefill speed of this engine (``recompute_source`` is ``prior``: nothing reported yet, or a daemon
    just restarted), the speed this scheduler measured (``tokens_per_s``), and without that the ceiling:
    a guessed speed could cut a load that beats recomputing (a fresh decode instance's whole prompt from
    the remote tier)."""
    if plan.get("recompute_source") == "prior":
        if not tokens_per_s:
            return ASYNC_WAIT_MAX_S
        recompute = n * block_tokens / tokens_per_s
    else:
        curve = plan["prefix_recompute_s"]
        recompute = float(curve[min(n, len(curve)) - 1]) if n > 0 and curve else 0.0
    return min(ASYNC_WAIT_MAX_S, max(ASYNC_WAIT_MIN_S, recompute))

"""Bandwidth budgets: a token bucket per link, so offload traffic cannot starve the engine.

A :class:`TokenBucket` admits bytes at ``rate`` bytes/s with bursts up to ``burst`` bytes; callers block
in :meth:`TokenBucket.acquire` until their bytes are admitted (or a timeout passes). Waiters are served
in arrival order, so a large transfer is not overtaken forever by small ones, and a request larger than
the burst is admitted once the bucket is full (the bucket then runs into debt that later callers wait
out), so the long-run rate holds for any request size. The rate can change at run time; ``None`` means
unlimited. :class:`LinkBudgets` holds one bucket per link and counts bytes, waits and busy time.
"""

from __future__ import annotations

import operator
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["LINKS", "LinkBudgets", "LinkStats", "TokenBucket", "link_name"]

LINKS = ("gpu<->host", "host<->disk", "host<->remote")
_TIER_ORDER = ("gpu", "host", "disk", "remote")
# Default burst when none is given: this much time at the configured rate.
_DEFAULT_BURST_S = 0.05
_MIN_BURST = 64 * 1024


def _check_rate(rate: float | None) -> float | None:
    if rate is None:
        return None
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0 or rate == float("inf"):
        raise ValueError(f"rate must be a positive number of bytes/s or None (unlimited), got {rate!r}")
    return float(rate)


def _check_nbytes(nbytes: int) -> int:
    try:
        value = operator.index(nbytes)  # numpy integers too
    except TypeError:
        value = -1
    if isinstance(nbytes, bool) or value < 0:
        raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
    return value


class TokenBucket:
    """A thread-safe token bucket.

    Args:
        rate: bytes per second, or ``None`` for unlimited.
        burst: bucket size in bytes: how much may pass at once after an idle spell. Default: 50 ms at
            ``rate`` (at least 64 KiB).
        clock: monotonic seconds (for tests).
    """

    def __init__(self, rate: float | None, burst: int | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()
        self._rate = _check_rate(rate)
        self._burst_given = burst is not None
        self._burst = self._pick_burst(self._rate, burst)
        self._tokens = float(self._burst)
        self._stamp = clock()
        self.bytes = 0
        self.acquires = 0
        self.timeouts = 0
        self.wait_s = 0.0

    @staticmethod
    def _pick_burst(rate: float | None, burst: int | None) -> int:
        if burst is None:
            return max(_MIN_BURST, int((rate or 0) * _DEFAULT_BURST_S))
        if isinstance(burst, bool) or not isinstance(burst, int) or burst <= 0:
            raise ValueError(f"burst must be a positive int of bytes, got {burst!r}")
        return burst

    @property
    def rate(self) -> float | None:
        """Bytes per second, or ``None`` when unlimited."""
        return self._rate

    @property
    def burst(self) -> int:
        """Bucket size in bytes."""
        return self._burst

    def set_rate(self, rate: float | None, burst: int | None = None) -> None:
        """Change the rate (and optionally the burst) now; waiting callers re-plan at once.

        Args:
            rate: bytes per second, or ``None`` for unlimited.
            burst: new bucket size; default keeps a given burst or rescales the default one.
        """
        rate = _check_rate(rate)
        with self._cond:
            self._refill()
            self._rate = rate
            if burst is not None:
                self._burst = self._pick_burst(rate, burst)
                self._burst_given = True
            elif not self._burst_given:
                self._burst = self._pick_burst(rate, None)
            self._tokens = min(self._tokens, float(self._burst))
            self._cond.notify_all()

    def acquire(self, nbytes: int, timeout: float | None = None) -> bool:
        """Block until ``nbytes`` may pass.

        Args:
            nbytes: bytes about to move.
            timeout: seconds to wait at most; ``None`` waits as long as needed, 0 only tries.

        Returns:
            True when admitted (the bytes are counted), False when the timeout passed first.
        """
        nbytes = _check_nbytes(nbytes)
        if timeout is not None and (isinstance(timeout, bool) or not timeout >= 0):
            raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout!r}")
        start = self._clock()
        deadline = None if timeout is None else start + timeout
        me = object()
        with self._cond:
            self._queue.append(me)
            try:
                while True:
                    now = self._clock()
                    wait = self._admit_wait(me, nbytes, now)
                    if wait == 0.0:
                        self.bytes += nbytes
                        self.acquires += 1
                        self.wait_s += now - start
                        return True
                    if deadline is not None and now >= deadline:
                        self.timeouts += 1
                        self.wait_s += now - start
                        return False
                    if deadline is not None:
                        wait = min(wait, deadline - now) if wait is not None else deadline - now
                    self._cond.wait(wait)
            finally:
                self._queue.remove(me)
                self._cond.notify_all()

    def _admit_wait(self, me: object, nbytes: int, now: float) -> float | None:
        """0.0 when ``me`` is admitted now (tokens taken); else seconds to wait, None for 'until notified'."""
        if self._rate is None:
            return 0.0
        if self._queue[0] is not me:
            return None
        self._refill(now)
        need = min(float(nbytes), float(self._burst))
        if self._tokens >= need:
            self._tokens -= nbytes  # may go negative: a request above the burst is paid back by waiting
            return 0.0
        return max((need - self._tokens) / self._rate, 1e-6)

    def _refill(self, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        if self._rate is None:
            self._tokens = float(self._burst)
        else:
            self._tokens = min(float(self._burst), self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now


@dataclass(slots=True)
class LinkStats:
    """Counters of one link (a snapshot)."""

    name: str
    rate: float | None
    burst: int
    bytes: int
    transfers: int
    wait_s: float
    busy_s: float
    timeouts: int

    def to_dict(self) -> dict[str, Any]:
        """Plain fields for JSON and the CLI."""
        return {"rate": self.rate, "burst": self.burst, "bytes": self.bytes, "transfers": self.transfers,
                "wait_s": self.wait_s, "busy_s": self.busy_s, "timeouts": self.timeouts}


def link_name(name: str) -> str:
    """Canonical link name: ``"host<->gpu"``, ``"gpu-host"`` and ``"gpu<->host"`` all name ``"gpu<->host"``.

    Raises:
        ValueError: not one of :data:`LINKS`.
    """
    if not isinstance(name, str):
        raise ValueError(f"link name must be a string, got {name!r}")
    parts = [p.strip().lower() for p in name.replace("<->", "-").split("-") if p.strip()]
    if len(parts) == 2 and all(p in _TIER_ORDER for p in parts):
        a, b = sorted(parts, key=_TIER_ORDER.index)
        canon = f"{a}<->{b}"
        if canon in LINKS:
            return canon
    raise ValueError(f"unknown link {name!r}; choose one of {LINKS}")


class LinkBudgets:
    """Token buckets for the links tierkv moves bytes over, with per-link stats.

    Args:
        rates: bytes/s per link name (see :func:`link_name`); a missing link or ``None`` is unlimited.
        bursts: bucket size in bytes per link (default: 50 ms at the link's rate).
        clock: monotonic seconds (for tests).
    """

    def __init__(self, rates: Mapping[str, float | None] | None = None,
                 bursts: Mapping[str, int] | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        rates = {link_name(k): v for k, v in (rates or {}).items()}
        bursts = {link_name(k): v for k, v in (bursts or {}).items()}
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets = {name: TokenBucket(rates.get(name), bursts.get(name), clock=clock) for name in LINKS}
        self._busy = dict.fromkeys(LINKS, 0.0)

    def bucket(self, link: str) -> TokenBucket:
        """The bucket of one link."""
        return self._buckets[link_name(link)]

    def set_rate(self, link: str, rate: float | None, burst: int | None = None) -> None:
        """Change one link's rate at run time (``None``: unlimited)."""
        self.bucket(link).set_rate(rate, burst)

    def acquire(self, link: str, nbytes: int, timeout: float | None = None) -> bool:
        """Wait until ``nbytes`` may cross ``link``; see :meth:`TokenBucket.acquire`."""
        return self.bucket(link).acquire(nbytes, timeout)

    def add_busy(self, link: str, seconds: float) -> None:
        """Count time spent moving bytes over ``link`` (when not using :meth:`transfer`)."""
        if not seconds >= 0:
            raise ValueError(f"seconds must be >= 0, got {seconds!r}")
        name = link_name(link)
        with self._lock:
            self._busy[name] += seconds

    @contextmanager
    def transfer(self, link: str, nbytes: int, timeout: float | None = None) -> Iterator[bool]:
        """Admit ``nbytes`` then time the body as busy time on the link.

        Yields:
            Whether the bytes were admitted; on False (timeout) the body should skip or defer the move.
        """
        ok = self.acquire(link, nbytes, timeout)
        start = self._clock()
        try:
            yield ok
        finally:
            if ok:
                self.add_busy(link, self._clock() - start)

    def stats(self) -> dict[str, LinkStats]:
        """Counters per link."""
        out = {}
        for name, b in self._buckets.items():
            with b._cond:
                out[name] = LinkStats(name, b.rate, b.burst, b.bytes, b.acquires, b.wait_s,
                                      self._busy[name], b.timeouts)
        return out

"""Circuit breakers of the remote tier, and which failure opens which.

A :class:`Breaker` is closed (up) until a failure; then open for a backoff (``base`` doubling up to
``cap``, with jitter), after which one caller is let through as a probe; the probe's success closes it,
its failure opens it again for longer. :class:`Breakers` pairs the link breaker (connection errors,
timeouts, server errors that are not about one key: while open, reads are misses and writes are
dropped) with the write breaker (a full server, an ACL that denies writes, a read-only replica, a
failing ``bgsave``: reads go on, the "read-only" state). :func:`classify` and :func:`reason_of` map
error replies and exceptions to those scopes. Plain code: callers hold :attr:`Breakers.lock`.
"""

from __future__ import annotations

import random
import threading
from typing import Any

__all__ = ["Breaker", "Breakers", "classify", "reason_of"]


class Breaker:
    """Closed (up) until a failure; then open for a backoff, after which one caller probes.

    Args:
        base: first backoff in seconds.
        cap: longest backoff in seconds.
    """

    def __init__(self, base: float, cap: float) -> None:
        if not (base > 0 and cap > 0):
            raise ValueError("backoffs must be > 0")
        self.base, self.cap = base, cap
        self.up = True
        self.failures = 0
        self.until = 0.0
        self.probing = False
        self.reason = ""

    def allow(self, now: float) -> bool:
        """Whether a call may go out now (True for at most one probe while open)."""
        if self.up:
            return True
        if self.probing or now < self.until:
            return False
        self.probing = True
        return True

    def due(self, now: float) -> bool:
        """Whether a call would be let through now (up, or open with its backoff passed)."""
        return self.up or now >= self.until

    def success(self) -> bool:
        """Close; returns True if it was open."""
        was_down = not self.up
        self.up, self.failures, self.probing, self.reason = True, 0, False, ""
        return was_down

    def failure(self, now: float, reason: str) -> None:
        """Open for the next backoff."""
        self.failures += 1
        wait = min(self.cap, self.base * 2 ** min(self.failures - 1, 30))
        self.until = now + wait * random.uniform(0.8, 1.2)  # jitter: N sidecars do not retry in step
        self.up, self.probing, self.reason = False, False, reason

    def release(self) -> None:
        """A probe ended without a verdict (nothing was sent)."""
        self.probing = False


class Breakers:
    """The link and write breakers of one tier, with the counts of their trips and recoveries.

    Args:
        base: first backoff in seconds.
        cap: longest backoff in seconds.
    """

    def __init__(self, base: float, cap: float) -> None:
        self.lock = threading.Lock()
        self.link = Breaker(base, cap)
        self.writes = Breaker(base, cap)
        self.trips = 0
        self.recoveries = 0

    def allow(self, now: float, write: bool) -> bool:
        """Whether a read (or a write) may go out now; a refused write releases its write probe."""
        if write and not self.writes.allow(now):
            return False
        if not self.link.allow(now):
            if write:
                self.writes.release()
            return False
        return True

    def writable(self, now: float) -> bool:
        """Whether a write would be let through now."""
        return self.link.due(now) and self.writes.due(now)

    def release(self, write: bool) -> None:
        """A call ended without a verdict (it raised before anything was learnt)."""
        self.link.release()
        if write:
            self.writes.release()

    def link_failed(self, now: float, reason: str, write: bool) -> None:
        """The link failed: open the link breaker (a write's probe ends without a verdict)."""
        self.link.failure(now, reason)
        self.trips += 1
        if write:
            self.writes.release()

    def succeeded(self, now: float, write: bool, write_error: str = "") -> list[str]:
        """A call got its replies; ``write_error`` is why the server refused writes ("" if it did not).

        Returns:
            What changed, for the log: ``"up"``, ``"refuses writes"``, ``"accepts writes"``.
        """
        events = []
        if self.link.success():
            self.recoveries += 1
            events.append("up")
        if write and write_error:
            if self.writes.up:
                self.trips += 1
                events.append("refuses writes")
            self.writes.failure(now, write_error)
        elif write and self.writes.success():
            self.recoveries += 1
            events.append("accepts writes")
        return events

    def state(self, now: float) -> dict[str, Any]:
        """``{"state": "up" | "down" | "read-only", "reason", "retry_in_s"}``."""
        if not self.link.up:
            st, br = "down", self.link
        elif not self.writes.up:
            st, br = "read-only", self.writes
        else:
            return {"state": "up", "reason": "", "retry_in_s": 0.0}
        return {"state": st, "reason": br.reason, "retry_in_s": round(max(0.0, br.until - now), 3)}


def classify(code: str, write: bool) -> tuple[str, str]:
    """(scope, reason) of an error reply's code: scope ``key`` (a miss), ``write`` (writes pause) or
    ``link`` (the tier goes down)."""
    if code in ("MOVED", "ASK", "TRYAGAIN"):
        return "key", "moved"
    if code == "WRONGTYPE":
        return "key", "wrongtype"
    if code == "OOM":
        return ("write", "full") if write else ("link", "oom")
    if code in ("READONLY", "MISCONF"):
        return ("write" if write else "link"), code.lower()
    if code == "NOPERM":
        return ("write" if write else "link"), "denied"
    return "link", code.lower() or "error"


def reason_of(exc: BaseException) -> str:
    """A short reason for a failed round trip: timeout, auth, connection, protocol, or the type's name."""
    import redis

    from tierkv.tiers.remote.resp import Desync

    if isinstance(exc, (redis.TimeoutError, TimeoutError)):
        return "timeout"
    if isinstance(exc, redis.AuthenticationError):
        return "auth"
    if isinstance(exc, (redis.ConnectionError, ConnectionError)):
        return "connection"
    if isinstance(exc, Desync):
        return "protocol"
    return type(exc).__name__


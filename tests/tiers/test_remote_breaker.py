"""The remote tier's circuit breakers (tierkv.tiers.remote.breaker): state machine and failure scopes,
in-process on a fake clock."""

from __future__ import annotations

import pytest
import redis
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tierkv.tiers.remote.breaker import Breaker, Breakers, classify, reason_of
from tierkv.tiers.remote.resp import Desync


def test_closed_until_a_failure_then_one_probe_after_the_backoff():
    b = Breaker(1.0, 8.0)
    assert b.allow(0.0) and b.allow(0.0)  # closed: everyone
    b.failure(10.0, "timeout")
    assert not b.up and b.reason == "timeout" and 10.8 <= b.until <= 11.2
    assert not b.allow(10.5) and not b.due(10.5)
    assert b.allow(11.3) and b.due(11.3)  # the probe
    assert not b.allow(11.3)              # only one
    b.failure(11.4, "timeout")            # the probe failed: twice as long
    assert 11.4 + 1.6 <= b.until <= 11.4 + 2.4
    assert b.allow(20.0)
    assert b.success() and b.up and b.failures == 0 and b.reason == ""
    assert not b.success()                # already closed


def test_backoff_doubles_up_to_the_cap():
    b = Breaker(0.5, 4.0)
    waits = []
    for _ in range(8):
        b.failure(0.0, "x")
        waits.append(b.until)
    assert all(0.4 <= w <= 0.6 * 2 ** i for i, w in enumerate(waits[:3]))
    assert all(3.2 <= w <= 4.8 for w in waits[3:])


def test_a_probe_without_a_verdict_lets_the_next_caller_probe():
    b = Breaker(1.0, 1.0)
    b.failure(0.0, "x")
    assert b.allow(5.0) and not b.allow(5.0)
    b.release()
    assert b.allow(5.0)


@pytest.mark.parametrize("bad", [(0, 1), (1, 0), (-1, 1)])
def test_bad_backoffs(bad):
    with pytest.raises(ValueError):
        Breaker(*bad)


def test_write_refusal_is_read_only_and_reads_go_on():
    bs = Breakers(1.0, 4.0)
    assert bs.allow(0.0, write=True)
    assert bs.succeeded(0.0, write=True, write_error="full") == ["refuses writes"]
    assert bs.state(0.5) == {"state": "read-only", "reason": "full", "retry_in_s": pytest.approx(0.5, abs=0.21)}
    assert bs.allow(0.5, write=False) and not bs.allow(0.5, write=True) and not bs.writable(0.5)
    assert bs.writable(2.0) and bs.allow(2.0, write=True)  # the write probe
    assert bs.succeeded(2.0, write=True) == ["accepts writes"]
    assert bs.state(2.0)["state"] == "up" and bs.trips == 1 and bs.recoveries == 1


def test_link_failure_is_down_for_reads_and_writes():
    bs = Breakers(1.0, 4.0)
    assert bs.allow(0.0, write=True)
    bs.link_failed(0.0, "connection", write=True)
    assert bs.state(0.1)["state"] == "down" and bs.state(0.1)["reason"] == "connection"
    assert not bs.allow(0.1, write=False) and not bs.allow(0.1, write=True)
    assert not bs.writes.probing  # the write's probe ended with the link's verdict
    assert bs.allow(2.0, write=False)
    assert bs.succeeded(2.0, write=False) == ["up"]
    assert bs.state(2.0) == {"state": "up", "reason": "", "retry_in_s": 0.0}


def test_a_refused_write_releases_its_write_probe():
    bs = Breakers(1.0, 1.0)
    bs.succeeded(0.0, write=True, write_error="denied")
    bs.link_failed(0.0, "timeout", write=False)
    # Both due at 2.0: the write takes the write probe, then finds the link probe taken by a read.
    assert bs.allow(2.0, write=False)
    assert not bs.allow(2.0, write=True)
    assert not bs.writes.probing


@pytest.mark.parametrize(("code", "write", "want"), [
    ("MOVED", False, ("key", "moved")), ("ASK", True, ("key", "moved")), ("TRYAGAIN", False, ("key", "moved")),
    ("WRONGTYPE", False, ("key", "wrongtype")),
    ("OOM", True, ("write", "full")), ("OOM", False, ("link", "oom")),
    ("READONLY", True, ("write", "readonly")), ("READONLY", False, ("link", "readonly")),
    ("MISCONF", True, ("write", "misconf")), ("NOPERM", True, ("write", "denied")),
    ("NOPERM", False, ("link", "denied")), ("LOADING", False, ("link", "loading")),
    ("CLUSTERDOWN", True, ("link", "clusterdown")), ("", False, ("link", "error")),
])
def test_classify(code, write, want):
    assert classify(code, write) == want


@pytest.mark.parametrize(("exc", "want"), [
    (redis.TimeoutError("t"), "timeout"), (TimeoutError(), "timeout"),
    (redis.AuthenticationError("a"), "auth"), (redis.ConnectionError("c"), "connection"),
    (ConnectionResetError(), "connection"), (Desync("d"), "protocol"), (OSError("o"), "OSError"),
])
def test_reason_of(exc, want):
    assert reason_of(exc) == want


class BreakerMachine(RuleBasedStateMachine):
    """Random calls, verdicts and clock steps: the breaker never lets two probes out at once and never
    waits past its cap."""

    def __init__(self) -> None:
        super().__init__()
        self.b = Breaker(0.25, 2.0)
        self.now = 0.0
        self.out = 0  # calls let out while open that have no verdict yet
        self.failed_at = 0.0

    @rule(dt=st.floats(0, 3))
    def tick(self, dt):
        self.now += dt

    @rule()
    def call(self):
        was_up = self.b.up
        if self.b.allow(self.now) and not was_up:
            self.out += 1

    @rule()
    def fail(self):
        self.b.failure(self.now, "x")
        self.failed_at = self.now
        self.out = 0

    @rule()
    def succeed(self):
        self.b.success()
        self.out = 0

    @rule()
    def release(self):
        self.b.release()
        self.out = 0

    @invariant()
    def one_probe_at_most(self):
        assert self.out <= 1
        assert self.b.up or 0.25 * 0.8 - 1e-9 <= self.b.until - self.failed_at <= 2.0 * 1.2 + 1e-9
        if self.b.up:
            assert self.b.allow(self.now) and self.b.failures == 0


TestBreakerMachine = BreakerMachine.TestCase
TestBreakerMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)

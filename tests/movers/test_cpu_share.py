"""The CPU share of work no request waits for: while the engine is busy it gets its share of a core and
no more, it runs freely once the engine leaves cores idle, and it gives way at once to work that must
not wait."""

from __future__ import annotations

import pytest

from tierkv.movers.cpu_share import BURST_S, CpuShare


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_while_the_engine_is_busy_bounded_work_gets_its_share_of_a_core():
    clock = Clock()
    share = CpuShare(0.25, busy=lambda: True, clock=clock, sleep=clock.sleep)
    for _ in range(40):  # 40 tasks of 50 ms of CPU each: 2 s of CPU at a quarter core
        share.wait_turn()
        clock.now += 0.05  # the task runs
        share.charge(0.05)
    # each task waits for its 50 ms to refill at 0.25 cores: 0.2 s of wall time per 0.05 s of CPU
    assert share.used_s == pytest.approx(2.0)
    assert clock.now == pytest.approx(2.0 / 0.25 - BURST_S / 0.25, rel=0.05)
    assert share.waited_s == pytest.approx(clock.now - 2.0, rel=0.05)


def test_an_idle_engine_or_work_queued_behind_lets_it_run_at_once():
    clock = Clock()
    busy = [True]
    share = CpuShare(0.25, busy=lambda: busy[0], clock=clock, sleep=clock.sleep)
    share.charge(1.0)  # far over its share
    share.wait_turn(give_way=lambda: True)  # a durable put waits behind it: no pause
    assert clock.now == 0.0
    busy[0] = False
    share.wait_turn()  # the engine left cores idle: catch up
    share.charge(5.0)  # not counted against the share while idle
    assert clock.now == 0.0 and share.used_s == 1.0
    off = CpuShare(0.0, busy=lambda: True, clock=clock, sleep=clock.sleep)
    off.charge(10.0)
    off.wait_turn()
    assert clock.now == 0.0 and off.used_s == 0.0


def test_timed_work_is_charged_its_thread_cpu_time():
    share = CpuShare(1000.0, busy=lambda: True)
    spins = share.timed(lambda: sum(range(200_000)))
    assert spins == sum(range(200_000)) and share.used_s > 0

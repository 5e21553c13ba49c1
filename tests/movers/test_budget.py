"""Bandwidth budgets: token buckets per link."""

from __future__ import annotations

import threading
import time

import pytest

from tierkv.movers.budget import LINKS, LinkBudgets, TokenBucket, link_name


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rate_holds_with_several_threads():
    rate, burst, chunk = 16e6, 1 << 20, 64 << 10
    bucket = TokenBucket(rate, burst)
    stop = time.monotonic() + 1.5
    start = time.monotonic()

    def push() -> None:
        while time.monotonic() < stop:
            bucket.acquire(chunk, timeout=1.0)

    threads = [threading.Thread(target=push) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    elapsed = time.monotonic() - start
    assert not any(t.is_alive() for t in threads)
    measured = (bucket.bytes - burst) / elapsed  # the full bucket passes at once at the start
    assert abs(measured / rate - 1) < 0.10, (measured, rate)
    assert bucket.acquires == bucket.bytes // chunk
    assert bucket.wait_s > 0


def test_refill_and_debt_with_a_fake_clock():
    clock = FakeClock()  # steps are powers of two so the float arithmetic is exact
    b = TokenBucket(1000, 100, clock=clock)
    assert b.acquire(100, timeout=0)
    assert not b.acquire(1, timeout=0)
    clock.now += 0.0625
    assert b.acquire(62, timeout=0) and not b.acquire(1, timeout=0)
    clock.now += 10  # refills only up to the burst
    assert b.acquire(100, timeout=0) and not b.acquire(1, timeout=0)
    # A request above the burst passes once the bucket is full, then later callers pay it back.
    clock.now += 1
    assert b.acquire(1000, timeout=0)
    clock.now += 0.875
    assert not b.acquire(50, timeout=0)
    clock.now += 0.125
    assert b.acquire(50, timeout=0)
    assert b.timeouts == 4 and b.bytes == 1312


def test_set_rate_takes_effect():
    clock = FakeClock()
    b = TokenBucket(1000, 1000, clock=clock)
    assert b.acquire(1000, timeout=0)
    b.set_rate(4000)
    clock.now += 0.25  # 1000 bytes at the new rate
    assert b.acquire(1000, timeout=0) and not b.acquire(1, timeout=0)
    b.set_rate(None)
    assert b.rate is None and b.acquire(10**12, timeout=0)

    # A caller blocked behind a very slow rate is released when the rate goes up.
    slow = TokenBucket(10e3, 10_000)
    assert slow.acquire(10_000, timeout=0)
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (slow.acquire(1 << 20), done.set()))  # ~100 s at 10 KB/s
    waiter.start()
    time.sleep(0.05)
    assert not done.is_set()
    slow.set_rate(1e9)
    waiter.join(timeout=5)
    assert done.is_set()

    # Lowering the rate holds back the next caller.
    fast = TokenBucket(1e9, 1 << 20, clock=clock)
    assert fast.acquire(1 << 20, timeout=0)
    fast.set_rate(1e3)
    clock.now += 0.01
    assert not fast.acquire(100, timeout=0)
    clock.now += 0.1
    assert fast.acquire(100, timeout=0)


def test_unlimited_never_waits():
    b = TokenBucket(None)
    for _ in range(1000):
        assert b.acquire(1 << 30, timeout=0)
    assert b.bytes == 1000 << 30 and b.timeouts == 0 and b.wait_s < 1.0


def test_timeout_returns_false():
    b = TokenBucket(1000, 1000)
    assert b.acquire(1000)
    t0 = time.monotonic()
    assert not b.acquire(1000, timeout=0.05)
    assert time.monotonic() - t0 < 2.0  # it gave up, it did not wait the whole second
    assert b.timeouts == 1


def test_waiters_are_served_in_arrival_order():
    b = TokenBucket(200e3, 20_000)
    assert b.acquire(20_000)
    order: list[int] = []

    def take(i: int) -> None:
        b.acquire(20_000)
        order.append(i)

    threads = []
    for i in range(4):
        t = threading.Thread(target=take, args=(i,))
        t.start()
        threads.append(t)
        deadline = time.monotonic() + 5
        while len(b._queue) < i + 1 and time.monotonic() < deadline:  # queued before the next one starts
            time.sleep(0.001)
    for t in threads:
        t.join(timeout=10)
    assert order == [0, 1, 2, 3]


@pytest.mark.parametrize("rate", [0, -1, float("nan"), float("inf"), "1e6", True])
def test_bad_rate(rate):
    with pytest.raises(ValueError):
        TokenBucket(rate)
    with pytest.raises(ValueError):
        TokenBucket(1e6).set_rate(rate)


def test_bad_values():
    for burst in (0, -5, 1.5, True):
        with pytest.raises(ValueError):
            TokenBucket(1e6, burst)
    b = TokenBucket(1e6)
    for nbytes in (-1, 1.5, True, "10"):
        with pytest.raises(ValueError):
            b.acquire(nbytes)
    with pytest.raises(ValueError):
        b.acquire(10, timeout=-1)
    for name in ("gpu<->disk", "host", "cpu<->gpu", 3):
        with pytest.raises(ValueError):
            link_name(name)
    with pytest.raises(ValueError):
        LinkBudgets({"gpu<->nvme": 1e9})
    with pytest.raises(ValueError):
        LinkBudgets({"gpu<->host": 0})
    with pytest.raises(ValueError):
        LinkBudgets().add_busy("gpu<->host", -1)


def test_link_budgets_names_stats_and_busy_time():
    clock = FakeClock()
    links = LinkBudgets({"host<->gpu": 1e6, "disk-host": None}, {"gpu<->host": 1 << 20}, clock=clock)
    assert link_name("HOST <-> GPU") == "gpu<->host" and link_name("remote-host") == "host<->remote"
    assert links.bucket("gpu<->host").rate == 1e6 and links.bucket("gpu<->host").burst == 1 << 20
    assert links.bucket("host<->remote").rate is None
    with links.transfer("gpu<->host", 4096) as ok:
        assert ok
        clock.now += 0.5
    assert links.acquire("host<->disk", 10 << 20, timeout=0)
    links.add_busy("host<->disk", 0.25)
    links.set_rate("host<->disk", 5e6)
    stats = links.stats()
    assert set(stats) == set(LINKS)
    assert stats["gpu<->host"].bytes == 4096 and stats["gpu<->host"].busy_s == pytest.approx(0.5)
    assert stats["host<->disk"].bytes == 10 << 20 and stats["host<->disk"].rate == 5e6
    assert stats["host<->disk"].busy_s == 0.25 and stats["host<->remote"].transfers == 0
    assert stats["gpu<->host"].to_dict()["transfers"] == 1
    assert links.acquire("gpu<->host", 2 << 20, timeout=0)  # a full bucket lets even a large request pass
    with links.transfer("gpu<->host", 4096, timeout=0) as ok:
        assert not ok
    assert links.stats()["gpu<->host"].timeouts == 1

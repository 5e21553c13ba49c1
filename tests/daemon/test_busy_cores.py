"""The engine's load as the daemon sees it: cores other processes kept busy lately."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tierkv.daemon.busy_cores import BusyCores


def test_averages_other_processes_over_the_window_and_leaves_its_own_out():
    readings = iter([(0.0, 0.0), (0.0, 0.0), (1.0, 0.0), (3.0, 1.0), (5.0, 1.0)])  # seconds
    now = iter([0.0, 0.05, 0.5, 1.0, 1.5])
    b = BusyCores(window=0.5, read=lambda: next(readings), clock=lambda: next(now))  # the first reading
    assert b.others() is None  # too soon after the first reading
    assert b.others() == 2.0   # a core busy for 0.5 s: 2 cores
    assert b.others() == 2.0   # 2 cores busy for 0.5 s, one of them this process's
    assert b.others() == 4.0   # the base moved to the reading 0.5 s old


def test_unknown_counters_never_hold_anything_back():
    b = BusyCores(read=lambda: None)
    assert b.others() is None and b.idle(1e9)


def _others_over(b: BusyCores, seconds: float) -> float:
    b.others()
    time.sleep(seconds)
    got = b.others()
    assert got is not None
    return got


def _readings(b: BusyCores) -> tuple[float, float, float, float, float]:
    """The reading quiet, with a spinning process, quiet again, with a spinning thread of this process,
    and the share of a core that thread ran."""
    quiet = _others_over(b, 0.8)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with_process = _others_over(b, 0.8)
    finally:
        spinner.kill()
        spinner.wait()
    quiet_again = _others_over(b, 0.8)
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    own0 = psutil.Process().cpu_times()
    t0 = time.monotonic()
    t = threading.Thread(target=spin)
    t.start()
    try:
        with_thread = _others_over(b, 0.8)
    finally:
        stop.set()
        t.join()
    own1 = psutil.Process().cpu_times()
    ran = (own1.user + own1.system - own0.user - own0.system) / (time.monotonic() - t0)
    return quiet, with_process, quiet_again, with_thread, ran


@pytest.mark.exclusive
def test_a_spinning_process_counts_and_a_spinning_thread_of_its_own_does_not():
    """Against the load the rest of the machine (other tests' servers, a type checker) adds meanwhile:
    a spinning process raises the reading by about a core, a spinning thread of this process does not.
    That load may change between two readings; up to three rounds are read, and one where it held
    still must show both."""
    b = BusyCores(window=0.5)
    cores = os.cpu_count() or 1
    for _ in range(3):
        quiet, with_process, quiet_again, with_thread, ran = got = _readings(b)
        counted = with_process >= quiet + 0.5 or with_process >= cores - 0.3  # all busy
        if counted and ran >= 0.3 and with_thread < max(quiet, quiet_again) + 0.5:
            return
    raise AssertionError(f"quiet, with a process, quiet, with a thread, the thread's share: {got}")

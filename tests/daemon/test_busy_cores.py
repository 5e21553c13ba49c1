"""The engine's load as the daemon sees it: cores other processes kept busy lately."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

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


def test_a_spinning_process_counts_and_a_spinning_thread_of_its_own_does_not():
    b = BusyCores(window=0.5)
    b.others()
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.8)
        assert b.others() >= 0.7
    finally:
        spinner.kill()
        spinner.wait()
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin)
    t.start()
    try:
        time.sleep(1.2)
        own = b.others()
    finally:
        stop.set()
        t.join()
    assert own is not None and own < 0.7

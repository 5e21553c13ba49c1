"""CPU priority of the movers' background threads: encoding and writing blocks to disk yields the
cores to the inference engine beside the daemon.

On Linux ``setpriority(PRIO_PROCESS, tid)`` sets one thread's nice value and
``sched_setscheduler(0, SCHED_IDLE)`` moves the calling thread to the idle class (it runs on cores no
other thread wants); neither needs privilege. Elsewhere, or where the call is refused, threads keep
the daemon's priority.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("tierkv.movers")

__all__ = ["lower_this_thread"]


def lower_this_thread(nice: int, idle: bool = False) -> bool:
    """Lower the calling thread's CPU priority by ``nice`` steps (the nice value is capped at 19), or with
    ``idle`` move it to the idle scheduling class; returns whether it was changed. 0 and no ``idle``
    leave it as it is."""
    if idle and hasattr(os, "sched_setscheduler"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return True
        except OSError as exc:
            log.debug("cannot move thread %d to the idle class: %s", threading.get_native_id(), exc)
    if nice <= 0 or not hasattr(os, "setpriority"):
        return False
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + nice))
    except OSError as exc:
        log.debug("cannot lower the priority of thread %d: %s", tid, exc)
        return False
    return True

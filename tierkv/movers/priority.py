"""CPU priority of the movers' background threads: encoding and writing blocks to disk yields the
cores to the inference engine beside the daemon.

On Linux ``setpriority(PRIO_PROCESS, tid)`` sets one thread's nice value; raising it needs no
privilege. Elsewhere, or where the call is refused, threads keep the daemon's priority.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("tierkv.movers")

__all__ = ["lower_this_thread"]


def lower_this_thread(nice: int) -> bool:
    """Lower the calling thread's CPU priority by ``nice`` steps (the nice value is capped at 19);
    returns whether it was changed. 0 leaves it as it is."""
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

"""Trace-driven simulator: replays request traces through the daemon's own policy classes.

The public names of the simulator, from the modules that hold them: traces
(:mod:`~tierkv.sim.trace`), sizes (:mod:`~tierkv.core.units`), settings (:mod:`~tierkv.sim.spec`),
the expanded workload (:mod:`~tierkv.sim.workload`), the replay loop
(:mod:`~tierkv.sim.simulator`), its figures (:mod:`~tierkv.sim.result`) and the request profile
(:mod:`~tierkv.sim.profile`).
"""

from tierkv.core.units import GIB, KIB, MIB, TIB, fmt_bytes, parse_capacity, parse_rate
from tierkv.sim.profile import profile
from tierkv.sim.result import ReplayResult, percentile
from tierkv.sim.simulator import Simulator, replay, sweep
from tierkv.sim.spec import ReplayConfig, TierSpec
from tierkv.sim.trace import Request, TraceError, load_trace, parse_trace
from tierkv.sim.workload import NEVER, Workload, prefill_seconds

__all__ = [
    "GIB", "KIB", "MIB", "NEVER", "TIB", "ReplayConfig", "ReplayResult", "Request", "Simulator",
    "TierSpec", "TraceError", "Workload", "fmt_bytes", "load_trace", "parse_capacity",
    "parse_rate", "parse_trace", "percentile", "prefill_seconds", "profile", "replay", "sweep",
]

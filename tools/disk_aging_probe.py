"""Disk eviction aged by idle time with a half-life that follows the disk: a probe, not the default.

The default placement (``configs/default.toml``) over host + disk, with the disk policy's order changed
to ``log2(value) + t_scored / tau``: a block's value halves every ``tau`` seconds without a use. ``tau``
is ``--scale`` times an exponentially weighted mean (weight 0.01) of the idle age of the disk's victims;
when it moves by more than 25% every disk block is re-scored with the new ``tau`` (each block keeps its
``log2(value)`` and the time it was scored). Prints the token hit rate beside the default's.

    python tools/disk_aging_probe.py ../shared/data/traces/mooncake_synthetic_trace.jsonl --host 2% --disk 30%
"""

from __future__ import annotations

import argparse
import math
import types
from pathlib import Path

from tierkv.ops.replay_cli import daemon_config, tiers_for
from tierkv.sim.config import ReplayConfig, TierSpec
from tierkv.sim.simulator import Simulator
from tierkv.sim.trace import load_trace
from tierkv.sim.workload import Workload


def simulator(w: Workload, host: str, disk: str) -> Simulator:
    """The default placement over host + disk, modelled as ``tierkv replay`` models it."""
    tiers = [TierSpec("host", host, read_bytes_per_s=25e9),
             TierSpec("disk", disk, read_bytes_per_s=5e9, latency_s=1e-4, compression=1.4, inclusive=True,
                      write_bytes_per_s=2e9)]
    return Simulator(w, "default", tiers_for("default", ReplayConfig(tiers=tiers), daemon_config(None), "all"))


def age_by_idle_time(pol, scale: float, start_s: float = 300.0) -> None:
    """Re-wire ``pol`` (an attention policy) to the idle-time order with a self-scaling ``tau``."""
    parts: dict = {}
    state = {"tau": start_s, "idle": start_s}

    def combine(self, key, freq, br, extra, p, cost):
        lv = math.log2(max((freq * br[0] * br[1] + extra) * p * cost, 1e-300))
        parts[key] = (lv, self.clock())
        return lv + self.clock() / state["tau"]

    remove = pol.on_remove

    def on_remove(key):
        if key in pol._last_victims and key in parts:
            state["idle"] = 0.99 * state["idle"] + 0.01 * (pol.clock() - parts[key][1])
            tau = max(10.0, scale * state["idle"])
            if abs(tau - state["tau"]) > 0.25 * state["tau"]:
                state["tau"] = tau
                for k in pol._size:
                    lv, t = parts[k]
                    pol._prio[k] = lv + t / tau
                pol._compact()
        remove(key)
        if key not in pol._size:
            parts.pop(key, None)

    pol._combine = types.MethodType(combine, pol)
    pol.on_remove = on_remove
    pol.aging_state = state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--host", default="2%")
    ap.add_argument("--disk", default="30%")
    ap.add_argument("--scale", type=float, default=0.65, help="tau as a multiple of the victims' idle age")
    args = ap.parse_args()
    w = Workload(load_trace(args.trace), 512, 512)
    base = simulator(w, args.host, args.disk).run(args.host)
    sim = simulator(w, args.host, args.disk)
    age_by_idle_time(sim.policies[1], args.scale)
    r = sim.run(args.host)
    st = sim.policies[1].aging_state
    print(f"default, host {args.host} + disk {args.disk}: {base.token_hit_rate * 100:.2f}% of tokens")
    print(f"idle-time aging (tau = {args.scale} x victims' idle age, {st['tau']:.0f} s at the end): "
          f"{r.token_hit_rate * 100:.2f}%, {r.disk_writes_bytes / 2**40:.2f} TiB written")


if __name__ == "__main__":
    main()

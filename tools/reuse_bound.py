"""How far a class-based online policy can go: the default with each block class's true return probability.

Pass 1 replays the default placement (``configs/default.toml``) over host + disk and records, for every
host victim the disk rule weighs, its reuse-model class and whether the trace uses it again later.
Pass 2 replays the same stack with each class's measured return probability in place of the learned
one: as the disk policy's reuse factor (``--on disk``), in the admission rule (``--on admission``) or
both. With ``--disk 0`` the stack is the host tier alone and ``--on host`` replaces the host policy's
learned reuse factor (the classes of the blocks it evicts) instead. The order of future requests is never used, so the result bounds what a perfectly trained
class-based policy reaches, beside OPT.

    python tools/reuse_bound.py ../shared/data/traces/mooncake_synthetic_trace.jsonl --host 2% --disk 30%
    python tools/reuse_bound.py ../shared/data/traces/mooncake_synthetic_trace.jsonl --host 10% --disk 0 --on host --within 60
    python tools/reuse_bound.py ../shared/data/traces/mooncake_synthetic_trace.jsonl --host 2% --disk 30% --warm
"""

from __future__ import annotations

import argparse
import bisect
import math
from collections import defaultdict
from pathlib import Path

from tierkv.ops.replay_cli import daemon_config, tiers_for
from tierkv.sim.simulator import Simulator
from tierkv.sim.spec import ReplayConfig, TierSpec
from tierkv.sim.trace import load_trace
from tierkv.sim.workload import Workload


def future_uses(w: Workload) -> dict:
    """Each page's use times, sorted."""
    uses: dict = defaultdict(list)
    for req, pages in zip(w.requests, w.pages):
        for p in pages:
            uses[p].append(req.timestamp_s)
    return uses


def simulator(w: Workload, host: str, disk: str) -> Simulator:
    """The default placement over host + disk (host alone for ``disk == "0"``), modelled as ``tierkv
    replay`` models it."""
    tiers = [TierSpec("host", host, read_bytes_per_s=25e9)]
    if disk != "0":
        tiers.append(TierSpec("disk", disk, read_bytes_per_s=5e9, latency_s=1e-4, compression=1.4,
                              inclusive=True, write_bytes_per_s=2e9))
    return Simulator(w, "default", tiers_for("default", ReplayConfig(tiers=tiers), daemon_config(None), "all"))


def class_rates(w: Workload, host: str, disk: str, uses: dict, within: float = 0.0) -> tuple[float, dict]:
    """Pass 1: the default's hit rate, and each class's fraction of victims used again later (within
    ``within`` seconds when it is > 0)."""
    sim = simulator(w, host, disk)
    model = sim.host_reuse if disk == "0" else sim.rules[1].model
    back: dict = defaultdict(int)
    seen: dict = defaultdict(int)
    weigh = model.left

    def left(key, now, horizon=None):
        c = model.block_class(key, now)
        u = uses[key]
        seen[c] += 1
        i = bisect.bisect_right(u, now)
        back[c] += i < len(u) and (within <= 0 or u[i] - now <= within)
        return weigh(key, now, horizon)

    model.left = left
    r = sim.run(host)
    return r.token_hit_rate, {c: back[c] / seen[c] for c in seen}


def with_true_rates(w: Workload, host: str, disk: str, rates: dict, on: str) -> tuple[float, int]:
    """Pass 2: the default with the measured class rates in place of the learned ones."""
    sim = simulator(w, host, disk)
    model = sim.host_reuse if disk == "0" else sim.rules[1].model

    def p(key, now):
        return rates.get(model.block_class(key, now), 0.5)

    if on in ("admission", "both"):
        model.p = p
    if on in ("disk", "both"):
        sim.policies[1].reuse = lambda key: p(key, sim.clock())
    if on == "host":
        sim.policies[0].reuse = lambda key: p(key, sim.clock())
    r = sim.run(host)
    return r.token_hit_rate, r.disk_writes_bytes


def warm_start(w: Workload, host: str, disk: str) -> tuple[float, float, int]:
    """The default cold, then again with the disk rule's class counts (its three models) learned in the first run: what
    learning the classes online costs on a trace this long."""
    cold = simulator(w, host, disk)
    r = cold.run(host)
    warm = simulator(w, host, disk)
    for name in ("model", "evict_model", "floor_model"):  # unscaled, unlike a restart
        getattr(warm.rules[1], name).load_counts(getattr(cold.rules[1], name).counts(), keep=math.inf)
    r2 = warm.run(host)
    return r.token_hit_rate, r2.token_hit_rate, r2.disk_writes_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--host", default="2%")
    ap.add_argument("--disk", default="30%")
    ap.add_argument("--on", choices=("disk", "admission", "both", "host"), default="disk")
    ap.add_argument("--warm", action="store_true",
                    help="instead: the default again, starting with the class counts a first run learned")
    ap.add_argument("--within", type=float, default=0.0,
                    help="count a victim as used again only within this many seconds (0: any time later)")
    args = ap.parse_args()
    if (args.disk == "0") != (args.on == "host"):
        ap.error("--on host goes with --disk 0 (the host tier alone), the other modes need a disk tier")
    w = Workload(load_trace(args.trace), 512, 512)
    if args.warm:
        if args.disk == "0":
            ap.error("--warm needs a disk tier")
        cold, warm, written = warm_start(w, args.host, args.disk)
        print(f"default, host {args.host} + disk {args.disk}: {cold * 100:.2f}% of tokens")
        print(f"warm start (the disk rule's learned classes from a first run): {warm * 100:.2f}%, "
              f"{written / 2**40:.2f} TiB written")
        return
    uses = future_uses(w)
    base, rates = class_rates(w, args.host, args.disk, uses, args.within)
    bound, written = with_true_rates(w, args.host, args.disk, rates, args.on)
    stack = f"host {args.host}" + (f" + disk {args.disk}" if args.disk != "0" else "")
    print(f"default, {stack}: {base * 100:.2f}% of tokens")
    print(f"true class probabilities ({args.on}): {bound * 100:.2f}%, {written / 2**40:.2f} TiB written")


if __name__ == "__main__":
    main()

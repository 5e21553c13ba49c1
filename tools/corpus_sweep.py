"""Replay the default placement, LRU and OPT over the trace corpus; print a table and write JSON.

Two tiers: host 2% + disk 30% of each trace's unique bytes (LRU writes every victim; OPT is the
ceiling, writing every victim). One tier: host 2 / 5 / 10%. The tiers are modelled as ``tierkv
replay`` models them (inclusive disk, 1.4x compression, 2 GB/s writer).

    python tools/corpus_sweep.py --synthetic ../shared/data/traces/mooncake_synthetic_trace.jsonl --json corpus.json
    python tools/corpus_sweep.py --synthetic TRACE --traces rag,agent --policies lru,default,attention
"""

from __future__ import annotations

import json
from dataclasses import asdict

import click

from tierkv.ops.replay_cli import daemon_config, tiers_for
from tierkv.sim.corpus import HELD_OUT, NAMES, requests
from tierkv.sim.result import ReplayResult
from tierkv.sim.simulator import sweep
from tierkv.sim.spec import ReplayConfig, TierSpec
from tierkv.sim.workload import Workload

TWO_TIER_HOST = ("2%",)
ONE_TIER_HOST = ("2%", "5%", "10%")


def stack(disk: str | None) -> ReplayConfig:
    """The replayed tiers: host, and a disk when ``disk`` is a capacity."""
    tiers = [TierSpec("host", "2%", read_bytes_per_s=25e9)]
    if disk:
        tiers.append(TierSpec("disk", disk, read_bytes_per_s=5e9, latency_s=1e-4, compression=1.4,
                              inclusive=True, write_bytes_per_s=2e9))
    return ReplayConfig(tiers=tiers)


def rows(name: str, setting: str, results: list[ReplayResult], policy: str) -> list[dict]:
    """One row per capacity: the policy beside LRU and OPT."""
    out = []
    for cap in dict.fromkeys(r.capacity for r in results):
        at = {r.policy: r for r in results if r.capacity == cap}
        pol, lru, opt = at[policy], at["lru"], at["opt"]
        out.append({
            "trace": name, "held_out": name in HELD_OUT, "setting": setting, "host": cap, "policy": policy,
            "hit": pol.token_hit_rate * 100, "lru": lru.token_hit_rate * 100, "opt": opt.token_hit_rate * 100,
            "to_lru": (pol.token_hit_rate - lru.token_hit_rate) * 100,
            "to_opt": (pol.token_hit_rate - opt.token_hit_rate) * 100,
            "x_lru": pol.token_hit_rate / lru.token_hit_rate if lru.token_hit_rate else None,
            "writes_x_lru": (pol.disk_writes_bytes / lru.disk_writes_bytes) if lru.disk_writes_bytes else None,
            "cpu_s": pol.cpu_s, "results": {k: asdict(v) for k, v in at.items()},
        })
    return out


def fmt(row: dict) -> str:
    w = f"{row['writes_x_lru']:.2f}x" if row["writes_x_lru"] is not None else "-"
    x = f"{row['x_lru']:.3f}" if row["x_lru"] is not None else "-"
    tag = "held out" if row["held_out"] else "tuning"
    return (f"{row['trace']:<10} {tag:<8} {row['setting']:<16} {row['policy']:<9} {row['hit']:6.2f} {row['lru']:6.2f} "
            f"{row['opt']:6.2f} {row['to_lru']:+6.2f} {x:>6} {row['to_opt']:+6.2f} {w:>6} {row['cpu_s']:5.1f}s")


@click.command()
@click.option("--synthetic", "synthetic", default=None, type=click.Path(dir_okay=False, exists=True),
              help="The Mooncake synthetic trace (left out of the corpus without it).")
@click.option("--traces", default=",".join(NAMES), show_default=True, help="Corpus traces to replay.")
@click.option("--policies", default="default", show_default=True, help="Policies beside lru and opt.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the generated traces.")
@click.option("--one-tier/--no-one-tier", default=True, show_default=True)
@click.option("--two-tier/--no-two-tier", default=True, show_default=True)
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False), help="Write the rows here.")
def main(synthetic: str | None, traces: str, policies: str, seed: int, one_tier: bool, two_tier: bool,
         json_path: str | None) -> None:
    """Print, per trace and setting, each policy's token hit rate beside LRU and OPT."""
    daemon = daemon_config(None)
    names = [n.strip() for n in traces.split(",") if n.strip()]
    pols = [p.strip() for p in policies.split(",") if p.strip()]
    out: list[dict] = []
    click.echo(f"{'trace':<10} {'set':<8} {'setting':<16} {'policy':<9} {'hit %':>6} {'lru':>6} {'opt':>6} "
               f"{'to lru':>6} {'x lru':>6} {'to opt':>6} {'writes':>6} {'cpu':>6}")
    for name in names:
        if name == "synthetic" and synthetic is None:
            continue
        w = Workload(requests(name, synthetic, seed))
        settings = ([("host+disk 30%", "30%", TWO_TIER_HOST)] if two_tier else []) + \
                   ([("host only", None, ONE_TIER_HOST)] if one_tier else [])
        for label, disk, caps in settings:
            res = sweep(w, ["lru", *pols], list(caps), stack(disk),
                        per_policy=lambda n, c: tiers_for(n, c, daemon, "all"))
            for pol in pols:
                for row in rows(name, label, res, pol):
                    out.append(row)
                    click.echo(fmt(row))
    click.echo("hit % is the token hit rate; 'to lru' / 'to opt' are points; 'writes' is disk bytes written "
               "over LRU write-all's")
    if json_path:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)
        click.echo(f"wrote {json_path}")


if __name__ == "__main__":
    main()

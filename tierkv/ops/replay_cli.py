"""``tierkv replay TRACE``: compare eviction policies on a request trace, or profile it."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Any

import click

from tierkv.cache.admission import MODES
from tierkv.cache.policy import policy_class, policy_names
from tierkv.core.units import parse_size
from tierkv.daemon.config import Config, load_config
from tierkv.sim.advise import advise_admission
from tierkv.sim.replay import (
    ReplayConfig,
    ReplayResult,
    TierSpec,
    TraceError,
    Workload,
    fmt_bytes,
    load_trace,
    parse_capacity,
    parse_rate,
    profile,
    sweep,
)


def _split(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _policy_settings(sets: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for item in sets:
        key, sep, value = item.partition("=")
        pol, dot, name = key.strip().partition(".")
        if not sep or not dot or not pol or not name:
            raise click.BadParameter(f"expected POLICY.KEY=VALUE, got {item!r}", param_hint="--set")
        cls = policy_class(pol)
        spec = cls.SETTINGS.get(name)
        if spec is None:
            raise click.BadParameter(f"policy {pol!r} has no setting {name!r} "
                                     f"(settings: {', '.join(cls.SETTINGS) or 'none'})", param_hint="--set")
        out.setdefault(pol, {})[name] = spec.coerce(name, value)
    return out


GATE_SETTINGS = ("min_return", "prior_weight", "idle_prior_weight")  # the daemon's store section, as replay's gate takes them
DEFAULT_CONFIG = Path(str(resources.files("tierkv").joinpath("configs", "default.toml")))  # package data


def daemon_config(path: Path | None) -> Config:
    """The daemon settings ``--policy default`` replays: ``path``, else configs/default.toml, else the
    built-in defaults (the environment is ignored: a replay does not depend on the shell)."""
    if path is None and DEFAULT_CONFIG.is_file():
        path = DEFAULT_CONFIG
    cfg = load_config(path, env={})
    cfg.validate()
    return cfg


def tiers_for(name: str, config: ReplayConfig, daemon: Config, admission: str) -> ReplayConfig:
    """The config policy ``name`` runs with: ``default`` takes each tier's policy, the policy weights,
    the disk's admission and idle aging from the daemon's settings; ``opt`` writes every victim (the
    true ceiling); any other policy uses ``admission``."""
    tiers = [TierSpec(**asdict(t)) for t in config.tiers]
    settings = {k: dict(v) for k, v in config.policy_settings.items()}
    for t in tiers[1:]:
        t.admission = "all" if name == "opt" else admission
    if name == "default":
        tiers[0].policy = daemon.host.policy
        tiers[0].policy_settings = {**tiers[0].policy_settings, "shadow_rate": daemon.host.shadow_rate}
        for t in tiers[1:]:
            t.policy, t.admission = daemon.disk.policy, daemon.disk.admission
            t.policy_settings = {**t.policy_settings, "idle_aging": daemon.disk.idle_aging,
                                 "shadow_rate": daemon.disk.order_shadow_rate}
        admission_settings = {"shadow_rate": daemon.disk.shadow_rate, **config.admission_settings}
        for pol in {t.policy for t in tiers}:
            assert pol is not None  # every tier's policy was set above
            settings[pol] = {**daemon.policy_settings(pol), **settings.get(pol, {})}
    fields = {f: getattr(config, f) for f in config.__dataclass_fields__}
    if name == "default":
        fields["admission_settings"] = admission_settings

    return ReplayConfig(**{**fields, "tiers": tiers, "policy_settings": settings})


def _table(results: list[ReplayResult], tiers: list[str]) -> str:
    lines = []
    by_cap: dict[str, list[ReplayResult]] = {}
    for r in results:
        by_cap.setdefault(r.capacity, []).append(r)
    for cap, rows in by_cap.items():
        lru = next((r.token_hit_rate for r in rows if r.policy == "lru"), None)
        opt = next((r.token_hit_rate for r in rows if r.policy == "opt"), None)
        lines.append(f"capacity {cap} ({fmt_bytes(rows[0].capacity_bytes)} in {tiers[0]})")
        head = f"  {'policy':<10} {'hit %':>6}" + "".join(f" {t + ' %':>7}" for t in tiers)
        head += (f" {'x lru':>6} {'to opt':>7} {'moved':>10} {'disk wr':>10} {'ttft p50':>9} {'p99':>8}"
                 f" {'cpu':>6}  admission")
        lines.append(head)
        for r in rows:
            x = f"{r.token_hit_rate / lru:.3f}" if lru else "-"
            gap = f"{(r.token_hit_rate - opt) * 100:+.1f}" if opt is not None else "-"
            line = f"  {r.policy:<10} {r.token_hit_rate * 100:6.2f}"
            line += "".join(f" {r.tier_hit_rate.get(t, 0.0) * 100:7.2f}" for t in tiers)
            line += (f" {x:>6} {gap:>7} {fmt_bytes(sum(r.bytes_moved.values())):>10}"
                     f" {fmt_bytes(r.disk_writes_bytes):>10} {r.ttft_p50_s:8.3f}s {r.ttft_p99_s:7.3f}s"
                     f" {r.cpu_s:5.1f}s  {r.admission}")
            lines.append(line)
        ref = rows[0]
        lines.append(f"  recompute-only TTFT p50 {ref.ttft_recompute_p50_s:.3f}s p99 {ref.ttft_recompute_p99_s:.3f}s; "
                     "'to opt' is points below Belady's oracle")
        for r in rows:
            if r.policy == "default":
                lines.append(f"  default: {r.placement}, admission {r.admission} (the daemon's configuration)")
            if r.store_offered:
                lines.append(f"  {r.policy}: the store gate stored {r.store_offered - r.store_skipped:,} of "
                             f"{r.store_offered:,} missed pages ({r.store_skipped:,} skipped as unlikely to pay, "
                             f"{r.store_idle:,} of them stored later, the engine idle)")
    return "\n".join(lines)


def _plot(results: list[ReplayResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = list(dict.fromkeys(r.capacity for r in results))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in dict.fromkeys(r.policy for r in results):
        rows = {r.capacity: r for r in results if r.policy == name}
        xs = [rows[c].capacity_bytes for c in caps if c in rows]
        ys = [rows[c].token_hit_rate * 100 for c in caps if c in rows]
        style = "--" if name == "opt" else "-"
        ax.plot(xs, ys, style, marker="o", label="opt (Belady)" if name == "opt" else name)
    xs = [next(r.capacity_bytes for r in results if r.capacity == c) for c in caps]
    if len(xs) > 1 and min(xs) > 0 and max(xs) / min(xs) > 8:
        ax.set_xscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels(caps)
    ax.minorticks_off()
    ax.set_xlabel("first-tier capacity")
    ax.set_ylabel("token hit rate (%)")
    ax.set_title("tierkv replay: hit rate vs capacity")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _print_profile(p: dict[str, Any]) -> None:
    rd, ws, cc, rec = p["reuse_distance"], p["working_set_bytes"], p["concurrency"], p["recommended"]
    pr = p["prefix_reuse"]
    echo = click.echo
    echo(f"requests            {p['requests']:,} over {p['duration_s']:.0f} s ({p['arrival_rate_per_s']:.2f}/s)")
    echo(f"prompt tokens       mean {p['input_tokens']['mean']:,.0f}, p50 {p['input_tokens']['p50']:,}, "
         f"p99 {p['input_tokens']['p99']:,}; output mean {p['output_tokens_mean']:,.0f}")
    echo(f"unique pages        {p['unique_pages']:,} x {fmt_bytes(p['page_bytes'])} = {fmt_bytes(p['unique_bytes'])}")
    echo(f"prefix reuse        {pr['token_hit_rate_unbounded'] * 100:.1f}% of prompt tokens hit an unbounded "
         f"cache; {pr['requests_with_prefix_hit'] * 100:.1f}% of requests share a prefix")
    echo(f"reuse distance      time p50 {rd['time_s']['p50']:.1f} s, p90 {rd['time_s']['p90']:.1f} s, "
         f"p99 {rd['time_s']['p99']:.1f} s")
    echo(f"                    bytes p50 {fmt_bytes(rd['bytes']['p50'])}, p90 {fmt_bytes(rd['bytes']['p90'])}, "
         f"p99 {fmt_bytes(rd['bytes']['p99'])}")
    echo(f"working set         per minute mean {fmt_bytes(ws['per_60s_mean'])}, max {fmt_bytes(ws['per_60s_max'])}; "
         f"per 10 min max {fmt_bytes(ws['per_600s_max'])}")
    echo(f"concurrency         mean {cc['mean']:.1f}, peak {cc['peak']} sequences "
         f"({fmt_bytes(cc['peak_live_kv_bytes'])} of live KV)")
    echo(f"recommended         gpu >= {fmt_bytes(rec['gpu_bytes'])}, host {fmt_bytes(rec['host_bytes'])}, "
         f"disk {fmt_bytes(rec['disk_bytes'])}")
    echo(f"                    ({rec['why']})")
    if "admission" in rec:
        runs = ", ".join(f"{m} {r['token_hit_rate'] * 100:.1f}% / {fmt_bytes(r['disk_writes_bytes'])} written"
                         for m, r in rec["admission_runs"].items())
        echo(f"admission           disk.admission = \"{rec['admission']}\" ({rec['admission_why']})")
        echo(f"                    default placement: {runs}; opt {rec['opt']['token_hit_rate'] * 100:.1f}%")
        shadow = ", ".join(f"{k} {r['token_hit_rate'] * 100:.2f}%" for k, r in rec["shadow_runs"].items())
        echo(f"host order          host.shadow_rate = {rec['shadow_rate']} ({shadow})")
        ratio = f"{rec['writes_ratio']:.2f}x" if rec["writes_ratio"] is not None else "-"
        echo(f"against the default {rec['gain_points']:+.2f} points of token hit rate, {ratio} the disk bytes "
             f"(the default configuration: {rec['default']['token_hit_rate'] * 100:.2f}%)")


@click.command("replay")
@click.argument("trace", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--policy", "policies", default="lru,default", show_default=True,
              help="Comma-separated policies to compare; 'default' is the daemon's placement as the config "
                   "sets it (per-tier policies and disk admission); Belady's OPT (writing every victim) is "
                   "always added as the ceiling.")
@click.option("--capacity", "capacities", default="2%,5%,10%", show_default=True,
              help="First-tier (host) capacities to sweep: % of the trace's unique bytes, or sizes like 8GiB.")
@click.option("--disk-capacity", default=None, help="Add a disk tier below host: a % or a size (e.g. 50%, 2TiB).")
@click.option("--page-tokens", default=512, show_default=True, type=click.IntRange(1),
              help="Tokens per cached page; each trace block is split into pages (e.g. 16).")
@click.option("--trace-block-tokens", default=512, show_default=True, type=click.IntRange(1),
              help="Tokens per hash_ids entry in the trace.")
@click.option("--kv-bytes-per-token", default=131072, show_default=True, type=click.IntRange(1),
              help="KV bytes per token (default: Llama-3-8B in bf16).")
@click.option("--host-bw", default="25GB/s", show_default=True, help="Host -> GPU bandwidth.")
@click.option("--disk-bw", default="5GB/s", show_default=True, help="Disk -> GPU bandwidth (raw bytes).")
@click.option("--disk-write-bw", default="2GB/s", show_default=True,
              help="Disk writer bandwidth (stored bytes); while it has nothing queued every host victim but "
                   "the tails under the admission floor is written, as the daemon's writer does. 0 leaves it "
                   "out: the admission rule decides all (so does disk.spare_writes = false in --config).")
@click.option("--disk-latency-ms", default=0.1, show_default=True, type=click.FloatRange(0))
@click.option("--disk-compression", default=1.4, show_default=True, type=click.FloatRange(1.0),
              help="Raw / stored bytes on disk.")
@click.option("--admission", type=click.Choice(MODES), default="all", show_default=True,
              help="Disk admission of the named policies other than 'default' and 'opt'.")
@click.option("--disk-admission/--no-disk-admission", default=None,
              help="Shorthand: --admission reused (written only if used again since it was cached, leased or pinned) / all.")
@click.option("--disk-exclusive", is_flag=True,
              help="A block read from disk gives up its disk copy (the daemon keeps it: inclusive).")
@click.option("--config", "config_path", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="Daemon TOML that 'default' replays [default: configs/default.toml].")
@click.option("--prefill-rate", default=10000.0, show_default=True, type=click.FloatRange(min=1e-9),
              help="Recompute speed, tokens/s at short context.")
@click.option("--attn-double-tokens", default=30000.0, show_default=True, type=click.FloatRange(0),
              help="Context at which a token's prefill cost doubles (0 = flat).")
@click.option("--set", "sets", multiple=True, metavar="POLICY.KEY=VALUE",
              help="A policy setting, e.g. attention.half_life_s=600 (repeatable).")
@click.option("--store-gate", type=click.Choice(["all", "predicted"]), default="all", show_default=True,
              help="Which missed pages are stored: all (as a plain client stores), or those the daemon's store "
                   "gate keeps, as an engine's vLLM connector asks it (store.* settings of the config).")
@click.option("--quota", "quota_args", multiple=True, metavar="TENANT:TIER=SIZE",
              help="A tenant's quota (trace lines name their tenant in 'tenant'), e.g. quiet:host=2GiB "
                   "(repeatable); decided as the daemon decides, with each tenant's hit rate reported.")
@click.option("--limit", default=None, type=click.IntRange(1), help="Replay only the first N requests.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False),
              help="Write a PNG of hit rate against capacity per policy.")
@click.option("--advise", is_flag=True, help="Print the request profile and recommended tier sizes instead.")
def replay(trace: Path, policies: str, capacities: str, disk_capacity: str | None, page_tokens: int,
           trace_block_tokens: int, kv_bytes_per_token: int, host_bw: str, disk_bw: str, disk_write_bw: str,
           disk_latency_ms: float, disk_compression: float, admission: str, disk_admission: bool | None,
           disk_exclusive: bool, config_path: Path | None, prefill_rate: float,
           attn_double_tokens: float, sets: tuple[str, ...], store_gate: str, quota_args: tuple[str, ...],
           limit: int | None, as_json: bool,
           plot_path: str | None, advise: bool) -> None:
    """Replay a Mooncake-format TRACE through the daemon's eviction policies.

    Reports per tier the token hit rate, bytes moved per boundary, disk writes and modelled
    time to first token, for every policy at every capacity, next to Belady's OPT.
    """
    try:
        names, caps = _check_names(policies), _split(capacities)
        if not caps:
            raise click.BadParameter("name at least one capacity", param_hint="--capacity")
        for c in caps + ([disk_capacity] if disk_capacity else []):
            parse_capacity(c, 1)
        tiers = [TierSpec("host", caps[0], read_bytes_per_s=parse_rate(host_bw))]
        daemon = daemon_config(config_path)
        if disk_capacity:
            tiers.append(TierSpec("disk", disk_capacity, read_bytes_per_s=parse_rate(disk_bw),
                                  latency_s=disk_latency_ms / 1000.0, compression=disk_compression,
                                  inclusive=not disk_exclusive, write_bytes_per_s=parse_rate(disk_write_bw) if daemon.disk.spare_writes else 0.0))
        if disk_admission is not None:
            admission = "reused" if disk_admission else "all"
        config = ReplayConfig(tiers=tiers, page_tokens=page_tokens, trace_block_tokens=trace_block_tokens,
                              kv_bytes_per_token=kv_bytes_per_token, prefill_tokens_per_s=prefill_rate,
                              attn_double_tokens=attn_double_tokens, policy_settings=_policy_settings(sets),
                              store_gate=store_gate, store_cost_bytes_per_s=float(daemon.store.cost_bytes_per_s),
                              store_gate_settings={k: v for k, v in asdict(daemon.store).items() if k in GATE_SETTINGS},
                              quotas=_quotas(quota_args))
        requests = load_trace(trace)
    except (TraceError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    if limit:
        requests = requests[:limit]
    if not requests:
        raise click.ClickException(f"{trace.name}: no requests")
    workload = Workload(requests, page_tokens, trace_block_tokens)

    def configure(name: str, cfg: ReplayConfig) -> ReplayConfig:
        return tiers_for(name, cfg, daemon, admission)

    if advise:
        _advise(workload, config, configure, as_json)
        return
    results = _sweep(workload, names, caps, config, configure)
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        click.echo(f"{trace.name}: {len(requests):,} requests, {workload.unique_pages:,} unique pages of "
                   f"{page_tokens} tokens ({fmt_bytes(workload.unique_pages * config.page_bytes)})")
        click.echo(_table(results, [t.name for t in tiers]))
        _print_tenants(results)
    if plot_path:
        _plot(results, plot_path)
        if not as_json:
            click.echo(f"plot written to {plot_path}")


def _print_tenants(results: list[ReplayResult]) -> None:
    for r in results:
        if r.tenant_hit_rate:
            rates = ", ".join(f"{t} {v * 100:.1f}%" for t, v in r.tenant_hit_rate.items())
            click.echo(f"tenants, {r.policy} at {r.capacity}: {rates}")


def _quotas(args: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """``--quota TENANT:TIER=SIZE`` values as ``{tenant: {tier: bytes}}``."""
    out: dict[str, dict[str, int]] = {}
    for arg in args:
        tenant, _, rest = arg.rpartition(":")
        tier, _, size = rest.partition("=")
        if not tenant or tier not in ("host", "disk") or not size:
            raise click.BadParameter(f"{arg!r}: expected TENANT:TIER=SIZE with TIER host or disk",
                                     param_hint="--quota")
        out.setdefault(tenant, {})[tier] = parse_size(size)
    return out


def _check_names(policies: str) -> list[str]:
    """The ``--policy`` names, each a registered policy, ``opt`` or ``default``."""
    names = _split(policies)
    if not names:
        raise click.BadParameter("name at least one policy", param_hint="--policy")
    known = [*policy_names(oracles=True), "default"]
    for n in names:
        if n not in known:
            raise click.BadParameter(f"unknown policy {n!r} (known: {', '.join(known)})", param_hint="--policy")
    return names


Configure = Callable[[str, ReplayConfig], ReplayConfig]


def _advise(workload: Workload, config: ReplayConfig, configure: Configure, as_json: bool) -> None:
    """Print the request profile, recommended sizes and the admission advice."""
    prof = profile(workload, config)
    rec = prof["recommended"]
    adv = advise_admission(workload, config, rec["host_bytes"], rec["disk_bytes"], configure)
    rec["admission"], rec["admission_why"], rec["admission_runs"] = adv["admission"], adv["why"], adv["runs"]
    rec["opt"] = adv["opt"]
    for k in ("shadow_rate", "shadow_runs", "default", "gain_points", "writes_ratio"):
        rec[k] = adv[k]
    if as_json:
        click.echo(json.dumps(prof, indent=2))
    else:
        _print_profile(prof)


def _sweep(workload: Workload, names: list[str], caps: list[str], config: ReplayConfig,
           configure: Configure) -> list[ReplayResult]:
    """Every policy at every capacity, with a progress bar."""
    from tierkv.core.progress import bar

    runs = len(caps) * len(dict.fromkeys([*names, "opt"]))
    with bar(runs, f"replaying {len(workload.requests):,} requests") as advance:
        def progress(r: ReplayResult) -> None:
            advance(1, f"{r.policy} @ {r.capacity}: {r.token_hit_rate * 100:.2f}%")

        return sweep(workload, names, caps, config, progress=progress, per_policy=configure)


if __name__ == "__main__":
    replay()

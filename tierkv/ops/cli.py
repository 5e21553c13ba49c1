"""The ``tierkv`` command: a thin click group over the daemon and the client."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

import click

from tierkv.client.admin import request
from tierkv.core.errors import TierKVError
from tierkv.core.units import format_size
from tierkv.daemon.config import default_socket, load_config
from tierkv.daemon.malloc import TUNABLES, start_malloc_trim

_SERVE_FLAGS = {
    "socket": "server.socket", "data_dir": "server.data_dir", "host_capacity": "host.capacity",
    "disk_capacity": "disk.capacity", "slab_bytes": "host.slab_bytes", "codec": "disk.codec",
    "no_disk": "disk.enabled", "policy": "host.policy", "disk_workers": "disk.workers",
    "log_level": "server.log_level", "remote": "remote.url", "remote_admission": "remote.admission",
    "gpu_capacity": "gpu.capacity", "gpu_device": "gpu.device", "metrics_addr": "server.metrics_addr",
    "control_token_file": "server.control_token_file",
    "kv_events": "events.endpoint", "kv_events_replay": "events.replay_endpoint",
}


class _Group(click.Group):
    """Errors print one line and exit non-zero; no tracebacks. Heavy subcommands load on first use."""

    LAZY = {"replay": "tierkv.ops.replay_cli", "verify": "tierkv.ops.admin_cli",
            "doctor": "tierkv.ops.admin_cli", "size": "tierkv.ops.size_cli", "top": "tierkv.ops.top",
            "lookup": "tierkv.ops.lookup_cli", "pd-proxy": "tierkv.ops.pd_proxy", "control": "tierkv.ops.control_cli"}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.LAZY))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        cmd = super().get_command(ctx, name)
        if cmd is None and name in self.LAZY:
            import importlib

            try:
                cmd = getattr(importlib.import_module(self.LAZY[name]), name.replace("-", "_"), None)
            except ImportError:
                return None  # an optional component is not installed: the command is absent
        return cmd

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except TierKVError as exc:
            click.echo(f"tierkv: {exc}", err=True)
            sys.exit(2)
        except ValueError as exc:
            click.echo(f"tierkv: {exc}", err=True)
            sys.exit(2)
        except OSError as exc:
            click.echo(f"tierkv: {exc.strerror or exc}", err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tierkv")
def main() -> None:
    """tierkv: a tiered KV-cache memory manager for LLM inference."""


@main.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML settings file.")
@click.option("--socket", help="Unix socket path.")
@click.option("--data-dir", help="Directory for the disk tier.")
@click.option("--host-capacity", help="Host tier size, e.g. 8GiB.")
@click.option("--disk-capacity", help="Disk tier size, e.g. 100GiB.")
@click.option("--slab-bytes", help="Host slab size, e.g. 32MiB.")
@click.option("--codec", help="Disk codec for new writes (lossless, zstd, raw, fp8, int8, int4).")
@click.option("--policy", help="Host eviction policy.")
@click.option("--disk-workers", type=int, help="Encode/decode worker threads.")
@click.option("--no-disk", is_flag=True, default=None, help="Run without the disk tier.")
@click.option("--remote", help="Shared remote tier: redis://, rediss://, unix://, or redis+cluster://h1:p1,h2:p2.")
@click.option("--remote-admission", type=click.Choice(["all", "reused", "pinned"]),
              help="Which blocks are written through to the remote tier.")
@click.option("--gpu-capacity", help="GPU tier size, e.g. 8GiB (0 = off, the default).")
@click.option("--gpu-device", help="GPU tier device: auto, cuda, cuda:N, or cpu (the CPU stand-in).")
@click.option("--metrics-addr", help="Serve Prometheus /metrics on PORT or HOST:PORT (loopback unless a host "
              "is given), e.g. 127.0.0.1:9464.")
@click.option("--control-token-file", help="A file (mode 600) with the bearer token the control API's pin, "
              "unpin, warm and delete need (served beside /metrics).")
@click.option("--kv-events", help="Publish KV events (vLLM's format, ZMQ PUB) on an endpoint, e.g. tcp://*:5557.")
@click.option("--kv-events-replay", help="ZMQ ROUTER endpoint answering replay requests, e.g. tcp://*:5558.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]))
def serve(config_path: str | None, **flags: Any) -> None:
    """Run the daemon in the foreground (SIGTERM/SIGINT drain and exit 0)."""
    _tune_allocator()
    if flags.get("no_disk"):
        flags["no_disk"] = False
    overrides = {_SERVE_FLAGS[k]: v for k, v in flags.items() if v is not None}
    cfg = load_config(config_path, overrides=overrides)
    logging.basicConfig(level=cfg.server.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.setswitchinterval(0.0005)  # short GIL slices keep request latency low beside encode threads
    from tierkv.daemon import memdebug
    from tierkv.daemon.server import Server

    server = Server(cfg)
    start_malloc_trim()  # see MALLOC_TRIM_S
    memdebug.start(server.memory_figures)  # no-op unless TIERKV_MEMDEBUG names a file
    sys.exit(server.serve())


def _tune_allocator() -> None:
    """Re-exec the daemon once with glibc tunables set (they are read only at process start)."""
    import os

    if "serve" not in sys.argv[1:] or os.environ.get("TIERKV_NO_REEXEC") or "glibc.malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return
    env = dict(os.environ)
    env["GLIBC_TUNABLES"] = ":".join(x for x in (env.get("GLIBC_TUNABLES", ""), TUNABLES) if x)
    env["TIERKV_NO_REEXEC"] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "tierkv", *sys.argv[1:]], env)


def _client_socket(socket: str | None) -> str:
    return socket or default_socket()


@main.command()
@click.option("--socket", help="Daemon socket path.")
def ping(socket: str | None) -> None:
    """Check that the daemon answers; prints the round-trip time."""
    t0 = time.perf_counter()
    r = request(socket, "PING")
    click.echo(f"pong from pid {r['pid']} in {(time.perf_counter() - t0) * 1e3:.2f} ms")


@main.command()
@click.option("--socket", help="Daemon socket path.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--watch", type=float, default=None, is_flag=False, flag_value=2.0,
              help="Refresh every N seconds (default 2) until interrupted.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True),
              help="Write a PNG of tier fill, hit rate and link bandwidth over the daemon's recent samples.")
def stats(socket: str | None, as_json: bool, watch: float | None, plot_path: str | None) -> None:
    """Per-tier capacity, usage, hits, misses, bytes, evictions, compression; per-namespace counts."""
    if plot_path is not None:
        from tierkv.ops.plot import render

        snap = request(socket, "STATS", {"samples": True})
        render(snap, plot_path, title=f"tierkv on {_client_socket(socket)}")
        click.echo(f"wrote {plot_path} ({len(snap['samples'])} samples, one every {snap['interval_s']:g} s)")
        return
    while True:
        r = request(socket, "STATS")
        if as_json:
            click.echo(json.dumps(r, sort_keys=True))
        else:
            _print_stats(r)
        if watch is None:
            return
        try:
            time.sleep(watch)
        except KeyboardInterrupt:
            return
        if not as_json:
            click.clear()


def _print_stats(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title=f"tierkv pid {r['pid']}: {r['clients']} clients, {r['leases']} leases, health {r['health']}")
    cols = ["tier", "capacity", "used", "blocks", "hits", "misses", "in", "out", "evictions", "demotions",
            "logical", "stored", "ratio", "frag"]
    for c in cols:
        t.add_column(c, justify="right" if c != "tier" else "left")
    for name, d in r["tiers"].items():
        t.add_row(name, format_size(d["capacity_bytes"]), format_size(d["used_bytes"]), str(d["blocks"]),
                  str(d["hits"]), str(d["misses"]), format_size(d["bytes_in"]), format_size(d["bytes_out"]),
                  str(d["evictions"]), str(d["demotions"]), format_size(d["bytes_logical"]),
                  format_size(d["bytes_stored"]), f"{d['compression_ratio']:.2f}x",
                  f"{d.get('fragmentation', 0):.1%}" if "fragmentation" in d else "-")
    console.print(t)
    li = r.get("lookup_index")
    if li:
        console.print(f"lookup index: {li['keys']} keys in {li['slots']} slots"
                      + (" (full: lookups go through the socket)" if li["overflow"] else ""))
    if r["namespaces"]:
        n = Table(title="namespaces")
        for c in ("fingerprint", "model", "identity", "layout", "tp", "blocks", "fetched", "missed"):
            n.add_column(c)
        for fp, d in r["namespaces"].items():
            lo = d["layout"]
            n.add_row(fp[:12], d["model"], d.get("identity", "")[:16] or "(by name)",
                      f"{lo['num_layers']}x{lo['num_kv_heads']}x{lo['head_dim']} "
                      f"T{lo['block_tokens']} {lo['dtype']}", str(d["tp_rank"]), str(d["blocks"]),
                      str(d.get("hits", 0)), str(d.get("misses", 0)))
        console.print(n)
    leased = [x for x in r.get("sessions", []) if x["leases"]]
    if leased:
        console.print("leases: " + ", ".join(f"pid {x['pid']} ({x['model'] or '-'}) {x['leases']} leases / "
                                             f"{x['leased_blocks']} blocks" for x in leased))


@main.command()
@click.option("--socket", help="Daemon socket path.")
def health(socket: str | None) -> None:
    """Print ok or degraded (exit 1 when degraded)."""
    r = request(socket, "HEALTH")
    click.echo(r["status"] + (f": {r['reason']}" if r.get("reason") else ""))
    sys.exit(0 if r["status"] == "ok" else 1)


@main.command()
@click.argument("assignments", nargs=-1, required=True)
@click.option("--socket", help="Daemon socket path.")
def tune(assignments: tuple[str, ...], socket: str | None) -> None:
    """Change settings of the running daemon: KEY=VALUE ... (e.g. host.policy=lru policy.beta=0.7
    host.capacity=512MiB budget.host_disk=200MB disk.codec=int8). All are checked first; a bad key or
    value changes nothing."""
    settings = {}
    for a in assignments:
        key, sep, value = a.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"{a!r} is not KEY=VALUE")
        settings[key.strip()] = value.strip()
    r = request(socket, "TUNE", {"settings": settings})
    click.echo("applied: " + ", ".join(r["applied"]))


@main.command()
@click.option("--socket", help="Daemon socket path.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def config(socket: str | None, as_json: bool) -> None:
    """Show the running daemon's effective settings and where each came from."""
    r = request(socket, "CONFIG")
    if as_json:
        click.echo(json.dumps(r, sort_keys=True))
        return
    for section, values in r["settings"].items():
        for key, value in values.items():
            src = r["sources"].get(f"{section}.{key}", "default")
            click.echo(f"{section}.{key} = {value!r}  ({src})")


@main.command()
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option("--socket", help="Daemon socket path.")
@click.option("--priority", type=click.IntRange(1, 100), default=80, show_default=True,
              help="Retention priority of the pinned prefix.")
def preload(path: str, socket: str | None, priority: int) -> None:
    """Store and pin a frozen prefix exported with tierkv.ops.preload.export_prefix (system prompts,
    tool descriptions) so it stays in the host tier."""
    from tierkv.core.progress import bar
    from tierkv.ops.preload import preload_file

    with bar(None, f"preloading {path}") as advance:
        model, n = preload_file(socket, path, priority, advance=advance)
    click.echo(f"pinned {n} blocks of {model} at priority {priority}")


if __name__ == "__main__":
    main()

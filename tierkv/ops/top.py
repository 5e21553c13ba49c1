"""``tierkv top``: a live terminal view of a running daemon, refreshed in place; ``q`` quits.

Rates (hit rate, bytes/s, evictions/s) are taken between two successive snapshots, so they describe the
last interval, not the daemon's lifetime.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from collections.abc import Iterator

import click
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from tierkv.core.units import format_size

BAR = 20


def _rate(cur: dict, prev: dict | None, key: str, dt: float) -> float:
    if prev is None or dt <= 0:
        return 0.0
    return max(0, cur.get(key, 0) - prev.get(key, 0)) / dt


def _hit_rate(cur: dict, prev: dict | None) -> str:
    """Hits over lookups in the last interval ("-" without lookups), else over the lifetime."""
    h, m = cur.get("hits", 0), cur.get("misses", 0)
    if prev is not None:
        h, m = h - prev.get("hits", 0), m - prev.get("misses", 0)
    return f"{h / (h + m):.0%}" if h + m > 0 else "-"


def fill_bar(used: int, capacity: int) -> Text:
    """A fixed-width bar: green below 85 %, yellow below 95 %, red above."""
    frac = min(1.0, used / capacity) if capacity else 0.0
    n = round(frac * BAR)
    style = "green" if frac < 0.85 else "yellow" if frac < 0.95 else "red"
    return Text.assemble(("█" * n, style), ("░" * (BAR - n), "dim"), f" {frac:4.0%}")


def _tiers(cur: dict, prev: dict | None, dt: float) -> Table:
    t = Table(title="tiers", title_justify="left", expand=False)
    for c in ("tier", "fill", "used / capacity", "blocks", "hit rate", "in/s", "out/s", "evictions", "evict/s"):
        t.add_column(c, justify="left" if c in ("tier", "fill") else "right")
    for name, d in cur["tiers"].items():
        p = (prev or {}).get("tiers", {}).get(name)
        t.add_row(name, fill_bar(d["used_bytes"], d["capacity_bytes"]),
                  f"{format_size(d['used_bytes'])} / {format_size(d['capacity_bytes'])}", f"{d['blocks']:,}",
                  _hit_rate(d, p), format_size(int(_rate(d, p, "bytes_in", dt))) + "/s",
                  format_size(int(_rate(d, p, "bytes_out", dt))) + "/s", f"{d.get('evictions', 0):,}",
                  f"{_rate(d, p, 'evictions', dt):.0f}")
    return t


def _namespaces(cur: dict, prev: dict | None) -> Table:
    t = Table(title="namespaces", title_justify="left")
    for c in ("model", "fingerprint", "blocks", "hit rate", "fetched"):
        t.add_column(c, justify="left" if c in ("model", "fingerprint") else "right")
    for fp, d in sorted(cur["namespaces"].items(), key=lambda kv: -kv[1]["blocks"]):
        p = (prev or {}).get("namespaces", {}).get(fp)
        t.add_row(d["model"], fp[:12], f"{d['blocks']:,}", _hit_rate(d, p), f"{d.get('hits', 0):,}")
    return t


def _clients(cur: dict) -> Table:
    engines = [s for s in cur.get("sessions", []) if s["model"]]  # control connections (CLI) have no model
    other = len(cur.get("sessions", [])) - len(engines)
    t = Table(title="clients" + (f" (and {other} control connections)" if other else ""), title_justify="left")
    for c in ("session", "pid", "model", "leases", "leased blocks"):
        t.add_column(c, justify="left" if c == "model" else "right")
    for s in sorted(engines, key=lambda s: -s["leased_blocks"]):
        t.add_row(str(s["session"]), str(s["pid"]), s["model"] or "-", str(s["leases"]), f"{s['leased_blocks']:,}")
    return t


def _links(cur: dict, prev: dict | None, dt: float, top: int = 6) -> Table:
    t = Table(title="busiest links", title_justify="left")
    for c in ("link", "bytes/s", "total"):
        t.add_column(c, justify="left" if c == "link" else "right")
    now = cur["transfer"]["bytes"]
    before = (prev or {}).get("transfer", {}).get("bytes", {})
    remote = cur["tiers"].get("remote")
    if remote is not None:
        now = dict(now, **{"host->remote": remote.get("bytes_in", 0), "remote->host": remote.get("bytes_out", 0)})
        r0 = (prev or {}).get("tiers", {}).get("remote") or {}
        before = dict(before, **{"host->remote": r0.get("bytes_in", 0), "remote->host": r0.get("bytes_out", 0)})
    rates = {k: _rate(now, before if prev else None, k, dt) for k in now}
    for link in sorted(now, key=lambda k: (-rates[k], -now[k]))[:top]:
        t.add_row(link, format_size(int(rates[link])) + "/s", format_size(now[link]))
    return t


def render(cur: dict, prev: dict | None, dt: float) -> RenderableType:
    """The whole screen for one snapshot (``prev``: the one before, for rates)."""
    req = _rate(cur, prev, "requests", dt)
    head = Text.assemble(("tierkv top", "bold"), f"  pid {cur['pid']}  up {cur['uptime_s']:.0f} s  "
                         f"{cur['clients']} clients  {cur['leases']} leased blocks  {req:,.0f} req/s  health ",
                         (cur["health"], "green" if cur["health"] == "ok" else "red"), ("   q quits", "dim"))
    return Group(head, _tiers(cur, prev, dt), _namespaces(cur, prev), _clients(cur), _links(cur, prev, dt))


@contextlib.contextmanager
def _keys() -> Iterator[bool]:
    """Unbuffered, unechoed keyboard input while inside; yields whether there is a terminal to read."""
    if not sys.stdin.isatty():
        yield False
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    old = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, old)


def _wait_quit(interval: float, tty: bool) -> bool:
    """Sleep up to ``interval`` seconds; True when ``q`` was pressed."""
    if not tty:
        time.sleep(interval)
        return False
    end = time.monotonic() + interval
    while (left := end - time.monotonic()) > 0:
        ready, _, _ = select.select([sys.stdin], [], [], left)
        if ready and os.read(sys.stdin.fileno(), 32).lower().find(b"q") >= 0:
            return True
    return False


@click.command()
@click.option("--socket", help="Daemon socket path.")
@click.option("--interval", type=click.FloatRange(0.1, 3600), default=1.0, show_default=True,
              help="Seconds between refreshes.")
def top(socket: str | None, interval: float) -> None:
    """Live view of a running daemon: tier fill, hit rates, bandwidth, evictions, namespaces, leases per
    client and the busiest links. Press q to quit."""
    from rich.live import Live

    from tierkv.client.admin import request

    cur = request(socket, "STATS")  # fail here, with a one-line error, before taking the screen
    t_cur = time.monotonic()
    with _keys() as tty, Live(render(cur, None, 0), screen=True, auto_refresh=False) as live:
        try:
            while not _wait_quit(interval, tty):
                prev, t_prev = cur, t_cur
                cur, t_cur = request(socket, "STATS"), time.monotonic()
                live.update(render(cur, prev, t_cur - t_prev), refresh=True)
        except KeyboardInterrupt:
            return

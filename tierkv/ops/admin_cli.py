"""Operator commands ``tierkv verify`` and ``tierkv doctor`` (loaded lazily by the CLI group).

``verify`` asks the running daemon to scrub its disk tier: every value's header, sizes and checksum
(against the namespace fingerprint and the key it is stored under) are checked, and bad entries are
reported and, with ``--drop``, deleted. ``doctor`` looks for what a crashed daemon or a bad set-up
leaves behind: stale socket files, loose permissions, stale LMDB reader slots, ``/dev/shm`` leftovers
and a file system too small for the configured disk tier, and says what the daemon's last start dropped
from the disk tier (blocks of an earlier format, of another namespace, corrupt). It prints one line per
finding.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import click

from tierkv.core.errors import TierKVError
from tierkv.core.units import format_size

LMDB_FILES = ("data.mdb", "lock.mdb")
SHM_DIR = Path("/dev/shm")
LOW_SPACE_FRACTION = 0.05  # warn when the data dir's file system has less than this share free


def _fail(message: str) -> NoReturn:
    click.echo(f"tierkv: {message}", err=True)
    sys.exit(2)


def _guarded(fn: Callable[[], None]) -> None:
    """Run a command body: tierkv and OS errors print one line and exit 2 (also outside the CLI group)."""
    try:
        fn()
    except TierKVError as exc:
        _fail(str(exc))
    except ValueError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"{exc.filename + ': ' if exc.filename else ''}{exc.strerror or exc}")


# ---- verify ---------------------------------------------------------------------------------------
VERIFY_TIMEOUT_S = 600.0  # a scrub decodes every value: minutes on a large disk tier
VERIFY_MAX_BAD = 100  # bad entries printed; the counts are always whole


@click.command()
@click.option("--drop", is_flag=True, help="Delete the bad entries (they are misses already).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--socket", help="Daemon socket path.")
@click.option("--timeout", type=click.FloatRange(min=0), default=VERIFY_TIMEOUT_S, show_default=True,
              help="Seconds to wait for the scrub (0 = no limit).")
@click.option("--max-bad", type=click.IntRange(min=0), default=VERIFY_MAX_BAD, show_default=True,
              help="List at most this many bad entries (0 = all); the counts cover every one.")
def verify(drop: bool, as_json: bool, socket: str | None, timeout: float, max_bad: int) -> None:
    """Scrub the disk tier: check every block's header and checksum; report (and drop) bad entries.

    Exits 1 when bad entries remain (found and not dropped), 0 when the tier is clean.
    """
    def run() -> None:
        from tierkv.client.admin import request
        from tierkv.core.progress import bar

        with bar(None, "verifying the disk tier"):  # one request: the daemon scans, we show the time
            r = request(socket, "VERIFY", {"drop": drop}, timeout=timeout or None)
        bad = list(r.get("bad", []))
        remaining = max(0, len(bad) - int(r.get("dropped", 0)))
        shown = bad[:max_bad] if max_bad else bad
        if as_json:
            click.echo(json.dumps({**r, "bad": shown, "bad_count": len(bad), "remaining": remaining},
                                  sort_keys=True))
        else:
            for entry in shown:
                click.echo(f"bad: {entry['key']}: {entry['error']}")
            if len(shown) < len(bad):
                click.echo(f"... {len(bad) - len(shown)} more bad entries not listed (--max-bad)")
            click.echo(f"checked {r['checked']} blocks: {len(bad)} bad, {r['dropped']} dropped")
        if remaining:
            sys.exit(1)

    _guarded(run)


# ---- doctor ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Finding:
    """One line of the doctor's report; ``level`` is ``ok``, ``warn`` or ``error``."""

    level: str
    text: str


def _mode(st: os.stat_result) -> str:
    return oct(stat.S_IMODE(st.st_mode))


def check_private_path(path: Path, what: str, want_dir: bool) -> list[Finding]:
    """A path the daemon uses: not a symlink, ours, not writable (error) or readable (warn) by others."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return []
    if stat.S_ISLNK(st.st_mode):
        return [Finding("error", f"{what} {path} is a symlink (to {os.readlink(path)}); the daemon refuses it")]
    if want_dir and not stat.S_ISDIR(st.st_mode):
        return [Finding("error", f"{what} {path} is not a directory")]
    out: list[Finding] = []
    if st.st_uid != os.getuid():
        out.append(Finding("error", f"{what} {path} belongs to uid {st.st_uid}, not to us ({os.getuid()})"))
    if st.st_mode & 0o022:
        out.append(Finding("error", f"{what} {path} is writable by group or others (mode {_mode(st)})"))
    elif st.st_mode & 0o077:
        out.append(Finding("warn", f"{what} {path} is readable by group or others (mode {_mode(st)}; "
                                   f"expected {'0o700' if want_dir else '0o600'})"))
    return out


def check_socket(path: Path) -> tuple[list[Finding], dict[str, Any] | None]:
    """The socket and its directory; the daemon's stats when one answers."""
    from tierkv.client.admin import request
    from tierkv.core.errors import ConnectionFailed

    out = check_private_path(path.parent, "socket dir", want_dir=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return out + [Finding("ok", f"no daemon socket at {path}")], None
    if not stat.S_ISSOCK(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a socket"
        return out + [Finding("error", f"{path} is {kind}; the daemon refuses to start there")], None
    if st.st_mode & 0o077:
        out.append(Finding("warn", f"socket {path} has mode {_mode(st)} (expected 0o600)"))
    try:
        stats = request(str(path), "STATS")
    except ConnectionFailed:
        return out + [Finding("warn", f"stale socket file {path}: no daemon behind it (the next start removes "
                                      "it; safe to delete)")], None
    disk = stats.get("tiers", {}).get("disk", {})
    out.append(Finding("ok", f"daemon pid {stats['pid']} answers on {path}: up {stats['uptime_s']:.0f}s, "
                             f"{stats['clients'] - 1} clients, {stats['leases']} leases, "
                             f"{disk.get('readers', 0)} LMDB reader slots"))
    if stats.get("health") != "ok":
        out.append(Finding("warn", f"daemon health is {stats.get('health')}"))
    return out, stats


def lmdb_holders(env_dir: Path) -> list[int]:
    """Pids (other than ours) with a file of the LMDB environment open."""
    import psutil

    targets = {os.path.realpath(env_dir / name) for name in LMDB_FILES}
    holders = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if any(f.path in targets for f in proc.open_files()):
                holders.append(proc.pid)
        except psutil.Error:
            continue  # gone, or not ours to look at
    return holders


def check_lmdb(env_dir: Path) -> list[Finding]:
    """Permissions of the LMDB files; stale reader slots when no daemon holds the environment."""
    out = check_private_path(env_dir, "disk tier dir", want_dir=True)
    if not (env_dir / "data.mdb").exists():
        return out
    for name in LMDB_FILES:
        out += check_private_path(env_dir / name, "LMDB file", want_dir=False)
    if any(f.level == "error" for f in out):
        return out
    holders = lmdb_holders(env_dir)
    if holders:
        return out + [Finding("ok", f"LMDB environment {env_dir} is open in pid {', '.join(map(str, holders))}; "
                                    "its owner clears stale reader slots")]
    import lmdb

    try:
        env = lmdb.open(str(env_dir), readonly=True, lock=True, subdir=True, max_readers=256, max_dbs=0)
    except lmdb.Error as exc:
        return out + [Finding("error", f"LMDB environment {env_dir} does not open: {exc}")]
    try:
        stale = env.reader_check()
        entries = env.stat()["entries"]
    finally:
        env.close()
    level = "warn" if stale else "ok"
    return out + [Finding(level, f"LMDB environment {env_dir}: {entries} entries, not in use, "
                                 f"{stale} stale reader slots cleared")]


def check_shm() -> list[Finding]:
    """tierkv shares memory through memfds, so any /dev/shm entry named tierkv* is a leftover."""
    try:
        entries = [e for e in os.scandir(SHM_DIR) if e.name.lower().startswith("tierkv")]
    except OSError:
        return []
    if not entries:
        return [Finding("ok", f"no tierkv entries in {SHM_DIR}")]
    out = []
    for e in entries:
        st = e.stat(follow_symlinks=False)
        out.append(Finding("warn", f"leftover shared memory {e.path} ({format_size(st.st_size)}, uid {st.st_uid})"))
    return out


def check_scan(data_dir: Path) -> list[Finding]:
    """What the daemon's last start dropped from the disk tier (``last-scan.json``, written by its scan)."""
    path = data_dir / "last-scan.json"
    try:
        d = json.loads(path.read_text())
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(d["at"])))
        blocks, earlier, foreign, corrupt = (int(d.get(k, 0)) for k in ("blocks", "earlier_format", "foreign",
                                                                         "corrupt"))
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [Finding("warn", f"{path} cannot be read ({exc})")]
    text = f"the daemon's last start ({at}) found {blocks} disk blocks"
    if not (earlier or foreign or corrupt):
        return [Finding("ok", text + " and dropped none")]
    parts = [f"{earlier} of an earlier format (keyed without the model's identity; no engine asks for them "
             "any more)" if earlier else "", f"{foreign} of another namespace than their key's" if foreign else "",
             f"{corrupt} corrupt" if corrupt else ""]
    return [Finding("ok", text + " and dropped " + ", ".join(p for p in parts if p))]


def check_space(data_dir: Path, capacity: int) -> list[Finding]:
    """Free space where the disk tier lives, against its configured capacity."""
    probe = data_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    vfs = os.statvfs(probe)
    free = vfs.f_bavail * vfs.f_frsize
    total = vfs.f_blocks * vfs.f_frsize
    try:
        used = os.stat(data_dir / "disk" / "data.mdb").st_size
    except OSError:
        used = 0
    text = f"{format_size(free)} free of {format_size(total)} on the file system of {data_dir}"
    if free + used < capacity:
        return [Finding("warn", f"{text}: less than the disk tier's capacity ({format_size(capacity)}); "
                                "writes will fail with 'tier full' before the tier is full")]
    if total and free < LOW_SPACE_FRACTION * total:
        return [Finding("warn", f"{text} (under {LOW_SPACE_FRACTION:.0%})")]
    return [Finding("ok", text)]


def diagnose(socket: str | None, data_dir: str | None) -> list[Finding]:
    """Every check, in order; the report of ``tierkv doctor``."""
    from tierkv.daemon.config import load_config

    cfg = load_config()
    sock = Path(socket or cfg.socket_path)
    data = Path(data_dir or cfg.server.data_dir)
    findings, _stats = check_socket(sock)
    if data.exists() or data.is_symlink():
        data_findings = check_private_path(data, "data dir", want_dir=True)
        findings += data_findings or [Finding("ok", f"data dir {data}: ours, mode {_mode(os.lstat(data))}")]
        if not any(f.level == "error" for f in data_findings):
            findings += check_lmdb(data / "disk") + check_scan(data)
    else:
        findings.append(Finding("ok", f"data dir {data} does not exist yet"))
    findings += check_shm()
    if cfg.disk.enabled:
        findings += check_space(data, cfg.disk.capacity)
    return findings


@click.command()
@click.option("--socket", help="Daemon socket path.")
@click.option("--data-dir", help="Data directory of the disk tier.")
def doctor(socket: str | None, data_dir: str | None) -> None:
    """Look for leftovers and set-up problems: stale sockets, permissions, stale LMDB readers, /dev/shm
    entries, free space. One line per finding; exits 1 when something needs attention."""
    def run() -> None:
        findings = diagnose(socket, data_dir)
        for f in findings:
            click.echo(f"{f.level}: {f.text}")
        if any(f.level != "ok" for f in findings):
            sys.exit(1)

    _guarded(run)

"""Pins and quotas kept across restarts: every change writes the pinned keys, their priorities, how many
pins hold each in host memory and on disk, the namespaces engines registered and the tenants' quotas
(``pins.msgpack`` in the data directory); a start reads it back, sets the quotas, registers those
namespaces (so the control API finds them before an engine connects), loads the blocks pinned in host
memory that are still on disk into host memory and pins them all again. A file that does not fit is
ignored (logged); writing it never fails a request. A graceful stop also writes which tenant with a
quota stored each block on disk (``tenants.msgpack``), so the next start counts them against its
quotas again (after ``kill -9`` those blocks count for no tenant until stored again).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import msgpack

from tierkv.cache.quotas import Quotas
from tierkv.cache.table import BlockTable
from tierkv.core.keys import Namespace
from tierkv.core.paths import replace_file

log = logging.getLogger("tierkv.daemon.pins")

FILE = "pins.msgpack"
TENANTS_FILE = "tenants.msgpack"
_MAX_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class Pin:
    """One pinned block: its key, its host priority, and the pins holding it in host memory and on disk."""

    fk: bytes
    priority: int
    host: int
    disk: int


def save(table: BlockTable, quotas: Quotas, data_dir: str | Path) -> bool:
    """Write the pinned blocks of ``table``, their namespaces and the tenants' quotas (atomically; lock
    held by the caller)."""
    pins = [(b.fk, b.pin, b.pins, b.disk_pins) for b in table.records() if b.pins or b.disk_pins]
    spaces = {fp: ns.to_dict() for fp, ns in table.namespaces.items()}  # the control API names them at start
    path = Path(data_dir) / FILE
    try:
        limits = {t: u.quota for t, u in quotas.tenants.items()}
        replace_file(path, msgpack.packb({"namespaces": spaces, "pins": pins, "quotas": limits}))
        return True
    except (OSError, ValueError, TypeError) as exc:
        log.warning("pins not saved to %s: %s", path, exc)
        return False


def load(data_dir: str | Path) -> tuple[dict[bytes, Namespace], list[Pin], dict[str, dict[str, int | None]]]:
    """The namespaces, the pins and the quotas a previous run kept; empty when there are none or the file
    does not fit."""
    path = Path(data_dir) / FILE
    try:
        if not path.is_file() or path.stat().st_size > _MAX_BYTES:
            return {}, [], {}
        data = msgpack.unpackb(path.read_bytes(), strict_map_key=False)
        spaces = {bytes(fp): Namespace.from_dict(d) for fp, d in data["namespaces"].items()}
        pins = [_pin(*p) for p in data["pins"]]
        quotas = {str(t): {str(tier): None if v is None else int(v) for tier, v in q.items()}
                  for t, q in data.get("quotas", {}).items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException) as exc:
        log.warning("pins not restored from %s: %s", path, exc)
        return {}, [], {}
    return ({fp: ns for fp, ns in spaces.items() if ns.fingerprint == fp}, [p for p in pins if p.host or p.disk],
            quotas)


def _pin(fk: bytes, priority: int, host: int = 1, disk: int = 0) -> Pin:
    """A stored entry; (key, priority) alone is one host pin."""
    priority, host, disk = int(priority), int(host), int(disk)
    if not 0 <= priority <= 100 or host < 0 or disk < 0 or (host > 0) != (priority > 0):
        raise ValueError(f"a pin entry out of range: priority {priority}, host {host}, disk {disk}")
    return Pin(bytes(fk), priority, host, disk)


def save_tenants(table: BlockTable, quotas: Quotas, data_dir: str | Path) -> None:
    """Write, per tenant with a quota, the keys of its blocks on disk (lock held by the caller)."""
    owned: dict[str, list[bytes]] = {}
    for b in table.records():
        if b.on_disk and b.tenant is not None and quotas.accounted(b.tenant):
            owned.setdefault(b.tenant, []).append(b.fk)
    path = Path(data_dir) / TENANTS_FILE
    try:
        replace_file(path, msgpack.packb(owned))
    except (OSError, ValueError, TypeError) as exc:
        log.warning("tenants not saved to %s: %s", path, exc)


def load_tenants(data_dir: str | Path) -> dict[bytes, str]:
    """Key -> tenant of the blocks a graceful stop wrote (the file is read once: removed after)."""
    path = Path(data_dir) / TENANTS_FILE
    try:
        if not path.is_file():
            return {}
        data = msgpack.unpackb(path.read_bytes(), strict_map_key=False) if path.stat().st_size <= _MAX_BYTES else {}
        path.unlink()
        return {bytes(fk): str(t) for t, keys in data.items() for fk in keys}
    except (OSError, ValueError, TypeError, AttributeError, msgpack.UnpackException) as exc:
        log.warning("tenants not restored from %s: %s", path, exc)
        return {}

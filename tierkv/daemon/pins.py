"""Pinned blocks kept across restarts: every pin change writes the pinned keys, their priorities and the
namespaces they belong to (``pins.msgpack`` in the data directory); a start reads it back, registers
those namespaces (so the control API finds them before an engine connects) and loads the pinned blocks
still on disk into host memory, pinned again. A file that does not fit is ignored (logged); writing it
never fails a request.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgpack

from tierkv.cache.table import BlockTable
from tierkv.core.keys import FINGERPRINT_BYTES, Namespace
from tierkv.core.paths import replace_file

log = logging.getLogger("tierkv.daemon.pins")

FILE = "pins.msgpack"
_MAX_BYTES = 64 << 20


def save(table: BlockTable, data_dir: str | Path) -> bool:
    """Write the pinned blocks of ``table`` and their namespaces (atomically; lock held by the caller)."""
    pins = [(b.fk, b.pin) for b in table.records() if b.pin]
    fps = {fk[:FINGERPRINT_BYTES] for fk, _ in pins}
    spaces = {fp: ns.to_dict() for fp in fps if (ns := table.namespaces.get(fp)) is not None}
    path = Path(data_dir) / FILE
    try:
        replace_file(path, msgpack.packb({"namespaces": spaces, "pins": pins}))
        return True
    except (OSError, ValueError, TypeError) as exc:
        log.warning("pins not saved to %s: %s", path, exc)
        return False


def load(data_dir: str | Path) -> tuple[dict[bytes, Namespace], list[tuple[bytes, int]]]:
    """The namespaces and the (key, priority) pins a previous run kept; empty when there are none or the
    file does not fit."""
    path = Path(data_dir) / FILE
    try:
        if not path.is_file() or path.stat().st_size > _MAX_BYTES:
            return {}, []
        data = msgpack.unpackb(path.read_bytes(), strict_map_key=False)
        spaces = {bytes(fp): Namespace.from_dict(d) for fp, d in data["namespaces"].items()}
        pins = [(bytes(fk), int(p)) for fk, p in data["pins"] if 1 <= int(p) <= 100]
    except (OSError, ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException) as exc:
        log.warning("pins not restored from %s: %s", path, exc)
        return {}, []
    return {fp: ns for fp, ns in spaces.items() if ns.fingerprint == fp}, pins

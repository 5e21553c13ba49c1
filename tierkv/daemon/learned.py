"""What the reuse models learned, kept across restarts: their class counts are written to the data
directory at shutdown and read at start-up, so a restarted daemon places blocks as the one before it
did instead of learning the classes again (docs/eviction-admission.md, "Across restarts").

Only per-class counts are kept (a few KiB), no keys. A file that does not fit (another format,
other output buckets, damaged) is ignored and the models start empty; saving never fails a shutdown.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgpack

from tierkv.cache.reuse import ReuseModel
from tierkv.core.paths import replace_file

log = logging.getLogger("tierkv.daemon.learned")

FILE = "reuse-classes.msgpack"
_MAX_BYTES = 1 << 20


def load(models: dict[str, ReuseModel], data_dir: str | Path) -> dict[str, bool]:
    """Load each model's counts from ``data_dir``; returns which ones were restored."""
    path = Path(data_dir) / FILE
    done = {name: False for name in models}
    try:
        if not path.is_file() or path.stat().st_size > _MAX_BYTES:
            return done
        data = msgpack.unpackb(path.read_bytes(), strict_map_key=False)
    except (OSError, ValueError, msgpack.UnpackException) as exc:
        log.warning("learned reuse classes not loaded from %s: %s", path, exc)
        return done
    if not isinstance(data, dict):
        log.warning("learned reuse classes not loaded from %s: not a map", path)
        return done
    for name, model in models.items():
        done[name] = model.load_counts(data.get(name))
    if not all(done.values()):
        log.info("learned reuse classes: restored %s", ", ".join(n for n, ok in done.items() if ok) or "none")
    return done


def save(models: dict[str, ReuseModel], data_dir: str | Path) -> bool:
    """Write every model's counts to ``data_dir`` (atomically); False, logged, if it could not."""
    path = Path(data_dir) / FILE
    try:
        replace_file(path, msgpack.packb({name: m.counts() for name, m in models.items()}))
        return True
    except (OSError, ValueError, TypeError) as exc:
        log.warning("learned reuse classes not saved to %s: %s", path, exc)
        return False

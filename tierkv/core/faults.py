"""Fault shim for tests: injects errors the real hardware cannot be made to produce on demand.

``TIERKV_FAULTS`` holds comma-separated rules ``<op>:<errno name>[:<probability>]`` for the disk tier,
e.g. ``read:EIO:0.5,write:ENOSPC``, or ``<op>:sleep=<seconds>`` to make a tier slow (cost-model and
priority tests). Unset (the normal case) means no shim at all.
"""

from __future__ import annotations

import errno
import os
import random
import time
from collections.abc import Callable


def disk_fault_from_env(env: dict[str, str] | None = None) -> Callable[[str], None] | None:
    """A callable the disk tier invokes before each ``read``/``write``, or None when no rule is set."""
    spec = (env if env is not None else os.environ).get("TIERKV_FAULTS", "").strip()
    if not spec:
        return None
    rules: dict[str, tuple[int, float]] = {}
    delays: dict[str, float] = {}
    for part in spec.split(","):
        fields = part.strip().split(":")
        if len(fields) == 2 and fields[0] in ("read", "write") and fields[1].startswith("sleep="):
            delays[fields[0]] = float(fields[1][len("sleep="):])
            continue
        if len(fields) not in (2, 3) or fields[0] not in ("read", "write") or not hasattr(errno, fields[1]):
            raise ValueError(f"bad TIERKV_FAULTS rule {part!r} (expected read|write:ERRNO[:probability])")
        rules[fields[0]] = (getattr(errno, fields[1]), float(fields[2]) if len(fields) == 3 else 1.0)
    rng = random.Random(0)

    def fault(op: str) -> None:
        if op in delays:
            time.sleep(delays[op])
        rule = rules.get(op)
        if rule is not None and rng.random() < rule[1]:
            raise OSError(rule[0], f"injected {errno.errorcode[rule[0]]} on disk {op}")

    return fault

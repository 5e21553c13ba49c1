"""Types of the shared lookup index extension (native/lookup.c)."""

from collections.abc import Sequence

from typing_extensions import Buffer

def init(buf: Buffer, /) -> int:
    """Format an empty index filling the writable ``buf``; the number of slots."""

def clear(buf: Buffer, /) -> None:
    """Empty the index and its overflow flag."""

def insert(buf: Buffer, fk: bytes, /) -> int:
    """1 added, 0 present, -1 full (the overflow flag is then set)."""

def remove(buf: Buffer, fk: bytes, /) -> int:
    """1 removed, 0 absent."""

def prefix(buf: Buffer, fingerprint: bytes, keys: Sequence[bytes], /) -> int:
    """How many leading keys are present, or -1 (ask the daemon)."""

def info(buf: Buffer, /) -> tuple[int, int, bool]:
    """(slots, count, overflow)."""

"""The shared lookup index: the block table's key set, mirrored into a memfd clients map read-only.

``client.lookup`` is the scheduler's hot path. Answered from this index it costs the client ~2 us and the
daemon nothing, where a socket round trip costs ~20 us of the daemon's GIL and, with several busy engine
processes on few cores, a tail set by scheduling. The table itself (hashing, probing, the seqlock that
lets readers run beside the one writer) is the C module ``tierkv._native._lookup``; without it (a build without
a compiler) lookups go through the socket as before.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
from typing import NoReturn

try:
    from tierkv._native import _lookup
except ImportError:  # the optional extension did not build: the socket path serves lookups
    _BUILT = False
else:
    _BUILT = True

log = logging.getLogger("tierkv.lookup")

HEADER_BYTES = 64
_F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1+: no new writable mappings (the daemon's own stays writable)


def available() -> bool:
    """Whether the C extension behind the index is installed."""
    return _BUILT


class LookupIndex:
    """Daemon side: a sealed memfd holding a hash set of ``fingerprint + key`` for every block in any
    local tier. One writer: every call is made under the block table's lock."""

    def __init__(self, slots: int) -> None:
        if not _BUILT:
            raise RuntimeError("tierkv._native._lookup is not built")
        nbytes = HEADER_BYTES + 8 * slots
        self.fd = os.memfd_create("tierkv-lookup", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, nbytes)
            self._mm = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self.slots = _lookup.init(self._mm)
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            try:  # clients can then map it read-only only: they cannot corrupt each other's lookups
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals | _F_SEAL_FUTURE_WRITE)
            except OSError:
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals)
        except BaseException:
            os.close(self.fd)
            raise
        self.overflowed = False

    def add(self, fk: bytes) -> None:
        """Mirror a new key. A full table (load 3/4) marks itself incomplete: clients then ask the daemon."""
        if _lookup.insert(self._mm, fk) < 0 and not self.overflowed:
            self.overflowed = True
            log.warning("lookup index full (%d slots): lookups go through the socket until the table "
                        "holds fewer blocks; raise server.lookup_index_slots", self.slots)

    def discard(self, fk: bytes) -> None:
        _lookup.remove(self._mm, fk)

    def rebuild(self, fks: list[bytes]) -> bool:
        """Refill from the table's keys (after an overflow, once they fit again). True if complete."""
        if 4 * len(fks) > 3 * self.slots:
            return False
        _lookup.clear(self._mm)
        for fk in fks:
            _lookup.insert(self._mm, fk)
        self.overflowed = False
        log.info("lookup index complete again (%d blocks)", len(fks))
        return True

    def info(self) -> dict:
        slots, count, overflow = _lookup.info(self._mm)
        return {"slots": slots, "keys": count, "overflow": overflow}

    def close(self) -> None:
        try:
            self._mm.close()
        finally:
            os.close(self.fd)


class IndexedBlocks(dict):
    """The block table's ``fk -> Block`` map, mirroring its key set into a :class:`LookupIndex`.

    Reads stay plain dict reads (``get`` and ``in`` are the C ones); only the mutators are wrapped, and the
    block table uses no others."""

    __slots__ = ("index",)

    def __init__(self, index: LookupIndex) -> None:
        super().__init__()
        self.index = index

    def __setitem__(self, fk: bytes, block: object) -> None:
        if fk not in self:
            self.index.add(fk)
        dict.__setitem__(self, fk, block)

    def __delitem__(self, fk: bytes) -> None:
        dict.__delitem__(self, fk)
        self.index.discard(fk)
        if self.index.overflowed and 2 * len(self) < self.index.slots:
            self.index.rebuild(list(self))

    def pop(self, fk: bytes, *default: object) -> object:
        if fk in self:
            block = dict.__getitem__(self, fk)
            del self[fk]
            return block
        if default:
            return default[0]
        raise KeyError(fk)

    def _unsupported(self, *args: object, **kw: object) -> NoReturn:
        raise NotImplementedError("IndexedBlocks supports item assignment, del and pop only")

    clear = update = setdefault = popitem = _unsupported


class ClientIndex:
    """Client side: the daemon's index mapped read-only."""

    def __init__(self, fd: int, remote: bool) -> None:
        try:
            self._mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)  # the mapping keeps it alive
        _lookup.info(self._mm)  # checks the header: a bad fd fails here, at connect
        self.remote = remote  # the daemon also looks past its local tiers (a remote tier)

    def prefix(self, fingerprint: bytes, keys: list[bytes]) -> int:
        """Leading ``keys`` cached in a local tier, or -1 when the daemon must answer (the index is
        incomplete, or kept changing during the read)."""
        return _lookup.prefix(self._mm, fingerprint, keys)

    def held(self, fingerprint: bytes, keys: list[bytes]) -> list[bool] | None:
        """Per key, whether a local tier holds it, or None when the daemon must answer."""
        mm, prefix = self._mm, _lookup.prefix
        found = [prefix(mm, fingerprint, (k,)) for k in keys]  # one probe each: a prefix walk stops at a miss
        return None if -1 in found else [n == 1 for n in found]

    def close(self) -> None:
        try:
            self._mm.close()
        except BufferError:
            pass

"""The disk tier's start-up scan: it rebuilds a record per stored value and drops values with a bad header
(``tierkv verify``, which decodes every value, is a mover job: :meth:`~tierkv.daemon.tier_jobs.TierJobs.verify`)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from tierkv.cache.block import Block
from tierkv.codecs import CodecError, read_header
from tierkv.core.errors import TierKVError
from tierkv.core.keys import FINGERPRINT_BYTES

if TYPE_CHECKING:
    from tierkv.daemon.blockstore import BlockStore

log = logging.getLogger("tierkv.table")


def _record(st: BlockStore, lk: bytes, value: memoryview) -> bool:
    """Record a stored value whose header names the key's namespace; False for a bad one."""
    try:
        h = read_header(value)
    except CodecError:
        return False
    if len(lk) <= FINGERPRINT_BYTES or bytes(h.fingerprint) != lk[:FINGERPRINT_BYTES]:
        return False
    st.diskp.added(st.table.add(Block(lk, h.raw_len, on_disk=True, disk_bytes=len(value))))
    return True


def scan_disk(st: BlockStore) -> None:
    """Rebuild records of every block on disk; a value with a bad header is dropped."""
    assert st.disk is not None
    t0 = time.perf_counter()
    bad = [lk for lk, value in st.disk.scan() if not _record(st, lk, value)]
    # The scan reads headers through its own page walk; a value is dropped only if LMDB's own read
    # agrees that it is bad (a walk that went wrong must never cost stored blocks).
    bad = [lk for lk in bad if not _recheck(st, lk)]
    if bad:
        st.disk.delete(bad)
        st.diskp.stats.corrupt += len(bad)
    log.info("disk tier: %d blocks (%d dropped as corrupt) scanned in %.2fs", len(st.table), len(bad),
             time.perf_counter() - t0)


def _recheck(st: BlockStore, lk: bytes) -> bool:
    """Re-check a value the start-up scan found bad, read through LMDB; a good one is recorded."""
    assert st.disk is not None

    def check(value: memoryview) -> int:
        if not _record(st, lk, value):
            raise CodecError("bad header or a namespace fingerprint that differs from the key's")
        return 1

    try:
        return bool(st.disk.read(lk, check))
    except (CodecError, TierKVError):
        return False

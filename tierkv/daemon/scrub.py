"""The disk tier's start-up scan: it rebuilds a record per stored value and drops values with a bad header
(``tierkv verify``, which decodes every value, is a mover job: :meth:`~tierkv.daemon.tier_jobs.TierJobs.verify`)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from tierkv.cache.block import Block
from tierkv.cache.disk_placement import DiskPlacement
from tierkv.cache.table import BlockTable
from tierkv.core.keys import FINGERPRINT_BYTES
from tierkv.movers.disk_scan import header_of, scan_headers
from tierkv.tiers.disk import DiskTier

if TYPE_CHECKING:
    from tierkv.codecs import BlockHeader

log = logging.getLogger("tierkv.table")


def _record(table: BlockTable, diskp: DiskPlacement, lk: bytes, found: tuple[BlockHeader | None, int] | None) -> bool:
    """Record a stored value whose header (and stored size) names the key's namespace; False for a bad one."""
    h, stored = found if found is not None else (None, 0)
    if h is None:
        return False
    if len(lk) <= FINGERPRINT_BYTES or bytes(h.fingerprint) != lk[:FINGERPRINT_BYTES]:
        return False
    diskp.added(table.add(Block(lk, h.raw_len, on_disk=True, disk_bytes=stored)))
    return True


def scan_disk(disk: DiskTier, table: BlockTable, diskp: DiskPlacement) -> None:
    """Rebuild the records in ``table`` (and ``diskp``'s figures) of every block on ``disk``; a value with
    a bad header is dropped. Runs at start-up, before any request."""
    t0 = time.perf_counter()
    bad = [lk for lk, h, stored in scan_headers(disk) if not _record(table, diskp, lk, (h, stored))]
    # The scan reads headers through its own page walk; a value is dropped only if LMDB's own read
    # agrees that it is bad (a walk that went wrong must never cost stored blocks).
    bad = [lk for lk in bad if not _record(table, diskp, lk, header_of(disk, lk))]
    if bad:
        disk.delete(bad)
        diskp.corrupt_dropped(len(bad))
    log.info("disk tier: %d blocks (%d dropped as corrupt) scanned in %.2fs", len(table), len(bad),
             time.perf_counter() - t0)

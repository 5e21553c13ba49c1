"""The disk tier's start-up scan: it rebuilds a record per stored value and drops values with a bad header,
of another namespace than their key's, or of an earlier format (``tierkv verify``, which decodes every
value, is a mover job: :meth:`~tierkv.daemon.tier_jobs.TierJobs.verify`). What the scan dropped is kept in
``last-scan.json`` in the data directory, where ``tierkv doctor`` reads it."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from tierkv.cache.block import Block
from tierkv.cache.disk_manager import DiskManager
from tierkv.cache.table import BlockTable
from tierkv.core.paths import replace_file
from tierkv.movers.disk_scan import CORRUPT, EARLIER, FOREIGN, REASONS, header_of, scan_headers
from tierkv.tiers.disk import DiskTier

log = logging.getLogger("tierkv.table")

SCAN_FILE = "last-scan.json"


def scan_disk(disk: DiskTier, table: BlockTable, diskm: DiskManager) -> dict[str, int]:
    """Rebuild the records in ``table`` (and ``diskm``'s figures) of every block on ``disk``; a bad value
    is dropped. Runs at start-up, before any request. Returns the blocks kept and dropped, by reason."""
    t0 = time.perf_counter()
    bad: dict[bytes, str] = {}
    for lk, h, stored in scan_headers(disk):
        if isinstance(h, str):
            bad[lk] = h
        else:
            diskm.found(table.add(Block(lk, h.raw_len)), stored)
    # The scan reads headers through its own page walk; a value is dropped only if LMDB's own read
    # agrees that it is bad (a walk that went wrong must never cost stored blocks).
    for lk in list(bad):
        found = header_of(disk, lk)
        if found is not None and not isinstance(found[0], str):
            diskm.found(table.add(Block(lk, found[0].raw_len)), found[1])
            del bad[lk]
    counts = {why: sum(1 for w in bad.values() if w == why) for why in REASONS}
    if bad:
        disk.delete(list(bad))
        diskm.stats.corrupt_dropped(counts[CORRUPT])
        diskm.stats.foreign_dropped(counts[FOREIGN])
        diskm.stats.earlier_dropped(counts[EARLIER])
    log.info("disk tier: %d blocks scanned in %.2fs; dropped %d of an earlier format, %d of another namespace "
             "than their key's, %d corrupt", len(table), time.perf_counter() - t0, counts[EARLIER],
             counts[FOREIGN], counts[CORRUPT])
    return {"blocks": len(table), **counts}


def save_scan(data_dir: str | os.PathLike[str], summary: dict[str, int]) -> None:
    """Keep what the start-up scan found (``tierkv doctor`` reports it); a failure only logs."""
    path = Path(data_dir) / SCAN_FILE
    try:
        replace_file(path, json.dumps({"at": time.time(), **summary}).encode())
    except OSError as exc:
        log.warning("cannot keep the start-up scan's summary in %s: %s", path, exc)

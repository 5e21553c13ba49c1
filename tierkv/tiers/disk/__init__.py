"""Disk tier: one LMDB environment in the data directory, opened only by the daemon, one writer.

Modules: ``tier`` (:class:`DiskTier`: scan, read, write, flush), ``pagemap`` (LMDB's page format, read in
place; pinned to the liblmdb versions it knows), ``mapping`` (the process's mappings of the data file),
``writeback`` (the commit's writeback kick), ``errors``.
"""

from tierkv.tiers.disk.errors import DiskError
from tierkv.tiers.disk.mapping import PAGE
from tierkv.tiers.disk.tier import DiskTier, stored_size

__all__ = ["PAGE", "DiskError", "DiskTier", "stored_size"]

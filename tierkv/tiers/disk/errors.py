"""Errors of the disk tier and how an LMDB or OS error maps onto them."""

from __future__ import annotations

import errno

from tierkv.core.errors import TierFull, TierKVError


class DiskError(TierKVError):
    """The disk failed (EIO and friends): the tier is degraded."""

    code = "disk"


def classify(exc: Exception) -> TierKVError:
    """A full map or file system is :class:`TierFull`; anything else is a :class:`DiskError`."""
    err = getattr(exc, "errno", None)
    text = str(exc)
    if err in (errno.ENOSPC, errno.EDQUOT) or "No space left" in text or "MDB_MAP_FULL" in text:
        return TierFull(f"disk tier is full: {text}")
    return DiskError(f"disk tier I/O error: {text}")

"""The start-up scan's reads: each value's header from the disk tier, parsed here (the movers run
codecs) and judged against its key; the daemon decides which records to rebuild and which values to drop."""

from __future__ import annotations

from collections.abc import Iterator

from tierkv.codecs import BlockHeader, CodecError, EarlierFormat, read_header
from tierkv.core.errors import TierKVError
from tierkv.core.keys import FINGERPRINT_BYTES
from tierkv.tiers.disk import DiskTier

# Why a value is dropped: it does not parse or fails a check; it is intact but of another namespace than
# its key's; an earlier tierkv wrote it.
CORRUPT, FOREIGN, EARLIER = "corrupt", "foreign", "earlier_format"
REASONS = (EARLIER, FOREIGN, CORRUPT)


def judge(lk: bytes, value: memoryview | bytes) -> BlockHeader | str:
    """The header of a value to keep under LMDB key ``lk``, or why it is bad (one of :data:`REASONS`)."""
    try:
        h = read_header(value)
    except EarlierFormat:
        return EARLIER
    except CodecError:
        return CORRUPT
    if len(lk) <= FINGERPRINT_BYTES or bytes(h.fingerprint) != lk[:FINGERPRINT_BYTES]:
        return FOREIGN
    return h


def scan_headers(disk: DiskTier) -> Iterator[tuple[bytes, BlockHeader | str, int]]:
    """Each stored value as ``(key, header or why it is bad, stored bytes)`` from the tier's page walk."""
    for lk, value in disk.scan():
        yield lk, judge(lk, value), len(value)


def header_of(disk: DiskTier, lk: bytes) -> tuple[BlockHeader | str, int] | None:
    """One value's header (or why it is bad) and stored size, read through LMDB itself; None when it is
    absent or cannot be read."""
    def parse(value: memoryview) -> tuple[BlockHeader | str, int]:
        return judge(lk, value), len(value)

    try:
        got = disk.read(lk, parse)
    except TierKVError:
        return None
    return got if isinstance(got, tuple) else None

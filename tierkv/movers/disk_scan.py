"""The start-up scan's reads: each value's header from the disk tier, parsed here (the movers run
codecs); the daemon decides which records to rebuild and which values to drop."""

from __future__ import annotations

from collections.abc import Iterator

from tierkv.codecs import BlockHeader, CodecError, read_header
from tierkv.core.errors import TierKVError
from tierkv.tiers.disk import DiskTier


def scan_headers(disk: DiskTier) -> Iterator[tuple[bytes, BlockHeader | None, int]]:
    """Each stored value as ``(key, header, stored bytes)`` from the tier's page walk; the header is
    None where it does not parse."""
    for lk, value in disk.scan():
        try:
            h: BlockHeader | None = read_header(value)
        except CodecError:
            h = None
        yield lk, h, len(value)


def header_of(disk: DiskTier, lk: bytes) -> tuple[BlockHeader, int] | None:
    """One value's header and stored size read through LMDB itself; None when it is absent, does not
    parse or cannot be read."""
    def parse(value: memoryview) -> tuple[BlockHeader, int]:
        return read_header(value), len(value)

    try:
        got = disk.read(lk, parse)
    except (CodecError, TierKVError):
        return None
    return got if isinstance(got, tuple) else None

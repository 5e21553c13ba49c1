"""Chunks of a streamed durable put: how a large durable put is cut so copies overlap disk writes.

A durable put larger than :data:`DURABLE_FIRST_CHUNK_BYTES` is sent in chunks, each chunk's copy
overlapping the disk write of the ones before. The chunks grow from the first size to
:data:`DURABLE_CHUNK_BYTES`: a small first chunk reaches the disk writer after a short copy, which
idles less between two durable puts.
"""

from __future__ import annotations

DURABLE_FIRST_CHUNK_BYTES = 4 << 20
DURABLE_CHUNK_BYTES = 32 << 20
SLOT_ALIGN = 4096  # the daemon rounds host slots up to whole pages


def slot_bytes(block_bytes: int) -> int:
    """Host slot bytes of a block."""
    return -(-block_bytes // SLOT_ALIGN) * SLOT_ALIGN


def durable_chunks(n: int, block_bytes: int, host_bytes: int | None = None) -> list[tuple[int, int]]:
    """(lo, hi) ranges of a streamed durable put of ``n`` blocks: doubling from the first chunk size.

    Args:
        n: blocks in the put.
        block_bytes: bytes of one block.
        host_bytes: the host tier's capacity; a chunk is at most a quarter of it, so a put larger than
            the host tier streams through it while earlier chunks are still being written.
    """
    top = max(1, DURABLE_CHUNK_BYTES // block_bytes)
    if host_bytes is not None:
        top = min(top, max(1, host_bytes // 4 // slot_bytes(block_bytes)))
    size = min(top, max(1, DURABLE_FIRST_CHUNK_BYTES // block_bytes))
    out, lo = [], 0
    while lo < n:
        out.append((lo, min(n, lo + size)))
        lo += size
        size = min(top, size * 2)
    first = out[0][1]
    if len(out) > 1 and out[-1][1] - out[-1][0] <= first:  # a tail no longer than the first chunk rides along
        out[-2:] = [(out[-2][0], n)]
    return out

"""Remote mover: encodes host blocks for the remote tier, sends them under the link budget, decodes fetches.

The remote tier (:mod:`tierkv.tiers.remote`) stores and fetches bytes; this module turns blocks into
those bytes and back. A write encodes batch i+1 on helper threads while batch i is on the wire (zstd,
xxhash and the container's join release the GIL) and admits each encoded value through the
``host<->remote`` token bucket before it is sent, so ``budget.host_remote`` caps the bytes put on the
link. A block the disk tier already holds, encoded with the remote's codec, is sent as the disk stores
it instead of being encoded again. A fetch admits the raw size of each block, then decodes every value
into its slot as it arrives; a value that fails verification is a miss, counted as corrupt and deleted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from tierkv.codecs import CodecError, ForeignBlock, decode_block, encode_block, read_header
from tierkv.core.errors import BadRequest, TierKVError
from tierkv.core.layout import Layout
from tierkv.movers.budget import LinkBudgets

if TYPE_CHECKING:
    from tierkv.tiers.remote import RemoteTier

__all__ = ["LINK", "DiskBlobs", "RemoteMover"]

LINK = "host<->remote"
Item = tuple[bytes, bytes, Any]  # (fingerprint, key, raw block)


class DiskBlobs(Protocol):
    """What the mover needs of the disk tier: a value by its key, handed to ``use`` in place."""

    def read(self, key: bytes, use: Callable[[memoryview], Any]) -> Any: ...


class RemoteMover:
    """Blocks between host buffers and one remote tier.

    Args:
        tier: the remote tier.
        budgets: link budgets; the ``host<->remote`` bucket paces writes and reads (None: unlimited).
        disk: the disk tier, whose stored blobs are reused when their codec is the remote's (None: never).
        encode_workers: threads that encode writes (started on first use).

    Raises:
        ValueError: ``encode_workers`` is below 1.
    """

    def __init__(self, tier: RemoteTier, *, budgets: LinkBudgets | None = None, disk: DiskBlobs | None = None,
                 encode_workers: int = 2) -> None:
        if encode_workers < 1:
            raise ValueError("encode_workers must be >= 1")
        self.tier = tier
        self.budgets = budgets if budgets is not None else LinkBudgets()
        self.disk = disk
        self.encode_workers = encode_workers
        self.encoded = 0  # blocks encoded for the remote
        self.reused = 0   # blocks sent as the disk tier stores them
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def store(self, items: Sequence[Item], layout: Layout, *, codec: str | None = None, level: int = 1,
              disk_keys: Sequence[bytes] | None = None) -> list[bool]:
        """Encode raw blocks with ``codec`` (default: the tier's) and put them; one stored flag per item.

        Nothing more is encoded once the tier is down or read-only. The raw buffers must stay unchanged
        until the call returns.

        Args:
            items: ``(fingerprint, key, raw)``, raw of ``layout.block_bytes``.
            layout: the blocks' layout.
            codec: codec name; default the tier's ``codec``.
            level: zstd level of the codec.
            disk_keys: the disk tier's key of each item, where its stored blob may be reused.

        Raises:
            ValueError: unknown codec or level; ``BadRequest`` for a raw buffer of the wrong size.
        """
        codec = codec or self.tier.codec
        step = self.tier.max_batch
        chunks = [range(i, min(i + step, len(items))) for i in range(0, len(items), step)]

        def encode(i: int) -> tuple[bytes, bytes, Any]:
            fp, k, raw = items[i]
            blob = self._disk_blob(disk_keys[i], codec) if disk_keys is not None else None
            reused = blob is not None
            if blob is None:
                blob = encode_block(raw, layout=layout, fingerprint=fp, key=k, codec=codec, level=level)
            with self._lock:
                self.reused += reused
                self.encoded += not reused
            return fp, k, blob

        def submit(c: int) -> list[Future]:
            return [self._encoder().submit(encode, i) for i in chunks[c]] if c < len(chunks) else []

        out: list[bool] = []
        nxt = submit(0) if self.tier.writable() else []
        try:
            for c in range(len(chunks)):
                if not nxt:
                    break
                enc = [f.result() for f in nxt]
                nxt = submit(c + 1)
                out.extend(self._put(enc))
                if nxt and not self.tier.writable():
                    break
        finally:
            # Never return while a helper may still read the caller's buffers.
            for f in nxt:
                if not f.cancel():
                    f.exception()
        if len(out) < len(items):
            self.tier.count_dropped(len(items) - len(out))
            out.extend([False] * (len(items) - len(out)))
        return out

    def fetch(self, items: Sequence[tuple[bytes, bytes]], layout: Layout, outs: Sequence[Any], *,
              delete_corrupt: bool = True) -> list[bool]:
        """Read blocks and decode them into ``outs``; True where ``outs[i]`` holds the block.

        Each value is decoded (checksum, namespace, layout and key verified) while the next ones arrive.
        A value that fails is a miss, counted as corrupt and deleted from the remote (``delete_corrupt``).

        Args:
            items: ``(fingerprint, key)`` per block.
            layout: the namespace's layout (a value of another layout is a miss).
            outs: writable C-contiguous buffers of ``layout.block_bytes``, one per item.

        Raises:
            BadRequest: ``outs`` does not match ``items`` (caller misuse).
        """
        if len(outs) != len(items):
            raise BadRequest("outs and items differ in length")
        for _ in items:
            self.budgets.acquire(LINK, layout.block_bytes)
        bad: list[int] = []
        foreign: list[int] = []

        def use(i: int, value: memoryview) -> bool:
            fp, k = items[i]
            try:
                decode_block(value, layout=layout, fingerprint=fp, key=k, out=outs[i])
                return True
            except ForeignBlock:
                foreign.append(i)
                return False
            except CodecError:
                bad.append(i)
                return False

        # Bound what a hostile value can make us allocate: a container is never much above the raw block.
        limit = layout.block_bytes + layout.block_bytes // 64 + (64 << 10)
        ok = self.tier.read_each(items, use, limit=limit)
        if bad or foreign:
            self.tier.drop_corrupt([items[i] for i in bad + foreign], delete=delete_corrupt, foreign=len(foreign))
        return ok

    def close(self) -> None:
        """Stop the encode threads (a later store starts them again)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _put(self, enc: list[tuple[bytes, bytes, Any]]) -> list[bool]:
        # Admit value by value: one large request would pass a full bucket at once.
        for _, _, blob in enc:
            self.budgets.acquire(LINK, len(blob))
        with self.budgets.transfer(LINK, 0):
            return self.tier.put_many(enc)

    def _disk_blob(self, key: bytes, codec: str) -> bytes | None:
        """The disk tier's blob of ``key`` when it is encoded with ``codec``; None otherwise."""
        if self.disk is None:
            return None

        def use(value: memoryview) -> bytes | None:
            return bytes(value) if read_header(value).codec == codec else None

        try:
            return self.disk.read(key, use)
        except (TierKVError, OSError, ValueError):  # a failing disk read or a bad header: encode again
            return None

    def _encoder(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.encode_workers, thread_name_prefix="tierkv-remote-encode")
            return self._pool

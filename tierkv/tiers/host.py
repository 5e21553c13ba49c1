"""Host tier: one shared-memory pool (a memfd) split into slabs of fixed-size slots.

The pool is a memfd, not a named ``/dev/shm`` entry: nothing can leak when a process dies, and clients
get it over the Unix socket with SCM_RIGHTS (no shared IPC namespace needed). The memfd is sealed
against shrinking so a client cannot truncate it under the daemon (which would SIGBUS it).

Namespaces with different block sizes share the pool without a fixed partition: slabs of
``slab_bytes`` are handed to a slot-size class on demand and return to the free list when their last
slot is freed (memcached-style slab classes). Slots are 4 KiB aligned.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from dataclasses import dataclass, field

import numpy as np

SLOT_ALIGN = 4096


def slot_size_for(block_bytes: int) -> int:
    """Slot bytes for a block: rounded up to 4 KiB so slots stay page aligned."""
    return (block_bytes + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


@dataclass(slots=True)
class _Slab:
    index: int
    slot_size: int
    nslots: int
    free: list[int] = field(default_factory=list)
    used: int = 0
    taken: bytearray = field(default_factory=bytearray)  # 1 per slot handed out: a second free is refused


def shared_mapping(name: str, nbytes: int, prefault: bool = True) -> tuple[int, mmap.mmap]:
    """A sealed memfd of ``nbytes`` and its shared mapping (clients receive the fd over SCM_RIGHTS)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        if prefault:
            # Commit the memory now: a short machine fails here, not with SIGBUS mid-write later.
            os.posix_fallocate(fd, 0, nbytes)
        # Sealed against resizing: a client cannot truncate the pool under the daemon (SIGBUS).
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        # Populated mapping: encode and decode touch slots the daemon has not touched before, and
        # ~500 page faults per 2 MiB slot cost more than the codec (measured in the disk path).
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if prefault else 0)
        return fd, mmap.mmap(fd, nbytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        os.close(fd)
        raise


class SlabAllocator:
    """Slot offsets in a region of ``nslabs`` slabs (memcached-style slab classes), without the memory.

    The host pool (a memfd) and the GPU tier's device pool share it. Not thread-safe: the block table
    serialises calls.

    Args:
        capacity: bytes of the region; what is left past the last whole slab is not used.
        slab_bytes: slab size, a multiple of 4 KiB. A region smaller than one slab is one slab of the
            region's size (rounded down to 4 KiB), so a small tier works with the default slab size.

    Raises:
        ValueError: ``slab_bytes`` is not a multiple of 4 KiB, or ``capacity`` is under 4 KiB.
    """

    def __init__(self, capacity: int, slab_bytes: int) -> None:
        if slab_bytes <= 0 or slab_bytes % SLOT_ALIGN:
            raise ValueError(f"slab_bytes must be a positive multiple of 4 KiB, got {slab_bytes}")
        slab_bytes = min(slab_bytes, capacity // SLOT_ALIGN * SLOT_ALIGN)
        self.slab_bytes = slab_bytes
        if slab_bytes < SLOT_ALIGN:
            raise ValueError(f"pool capacity must be at least 4 KiB, got {capacity}")
        self.nslabs = capacity // slab_bytes
        self.capacity = self.nslabs * slab_bytes
        self._slabs: list[_Slab | None] = [None] * self.nslabs
        self._free_slabs = list(range(self.nslabs - 1, -1, -1))
        self._partial: dict[int, dict[int, None]] = {}  # slot size -> slabs with a free slot (ordered set)
        self.used_bytes = 0
        self.used_slots = 0

    def alloc(self, slot_size: int) -> int | None:
        """Offset of a free slot of ``slot_size`` bytes, or None when the pool has no room for it.

        Raises:
            ValueError: ``slot_size`` is not a positive multiple of 4 KiB, or larger than a slab.
        """
        if slot_size <= 0 or slot_size % SLOT_ALIGN:
            raise ValueError(f"a slot size must be a positive multiple of 4 KiB, got {slot_size}")
        if slot_size > self.slab_bytes:
            raise ValueError(f"a slot of {slot_size} bytes does not fit a {self.slab_bytes}-byte slab")
        partial = self._partial.setdefault(slot_size, {})
        if partial:
            slab = self._slabs[next(iter(partial))]
        elif self._free_slabs:
            idx = self._free_slabs.pop()
            n = self.slab_bytes // slot_size
            slab = _Slab(idx, slot_size, n, list(range(n - 1, -1, -1)), taken=bytearray(n))
            self._slabs[idx] = slab
            partial[idx] = None
        else:
            return None
        assert slab is not None
        slot = slab.free.pop()
        slab.taken[slot] = 1
        slab.used += 1
        if not slab.free:
            del partial[slab.index]
        self.used_bytes += slot_size
        self.used_slots += 1
        return slab.index * self.slab_bytes + slot * slot_size

    def free(self, offset: int) -> None:
        """Return a slot; a slab whose last slot is freed goes back to the shared free list.

        Raises:
            ValueError: ``offset`` is not a slot handed out by :meth:`alloc` and not freed since.
        """
        slab = self._slab_of(offset)
        slot, rem = divmod(offset - slab.index * self.slab_bytes, slab.slot_size)
        if rem or slot >= slab.nslots or not slab.taken[slot]:
            raise ValueError(f"offset {offset} is not an allocated slot")
        slab.taken[slot] = 0
        slab.free.append(slot)
        slab.used -= 1
        self.used_bytes -= slab.slot_size
        self.used_slots -= 1
        partial = self._partial[slab.slot_size]
        if slab.used == 0:
            partial.pop(slab.index, None)
            self._slabs[slab.index] = None
            self._free_slabs.append(slab.index)
        else:
            partial[slab.index] = None

    def slot_size_at(self, offset: int) -> int:
        """The slot size of the slab holding ``offset``."""
        return self._slab_of(offset).slot_size

    def fragmentation(self, live_bytes: int) -> float:
        """1 - live block bytes / bytes of slabs handed to slot classes (0 when nothing is assigned)."""
        assigned = (self.nslabs - len(self._free_slabs)) * self.slab_bytes
        return 0.0 if assigned == 0 else max(0.0, 1.0 - live_bytes / assigned)

    def slab_usage(self) -> dict[int, int]:
        """Slabs per slot size."""
        out: dict[int, int] = {}
        for slab in self._slabs:
            if slab is not None:
                out[slab.slot_size] = out.get(slab.slot_size, 0) + 1
        return out

    def _slab_of(self, offset: int) -> _Slab:
        if not (0 <= offset < self.capacity):
            raise ValueError(f"offset {offset} outside the pool")
        slab = self._slabs[offset // self.slab_bytes]
        if slab is None:
            raise ValueError(f"offset {offset} is in a free slab")
        return slab


class HostPool(SlabAllocator):
    """The memfd pool and its slab allocator. Not thread-safe: the block table serialises calls."""

    def __init__(self, capacity: int, slab_bytes: int, prefault: bool = True) -> None:
        super().__init__(capacity, slab_bytes)
        self.fd, self.mm = shared_mapping("tierkv-host", self.capacity, prefault)
        self.array = np.frombuffer(self.mm, dtype=np.uint8)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """A uint8 numpy view of ``nbytes`` at ``offset`` (no copy)."""
        return self.array[offset:offset + nbytes]

    def close(self) -> None:
        """Unmap and close the memfd (clients' mappings stay valid until they unmap)."""
        try:
            self.array = np.empty(0, np.uint8)
            self.mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes when the process exits
        os.close(self.fd)

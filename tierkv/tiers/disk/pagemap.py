"""LMDB's on-disk page format, read in place: walk or search the B-tree of one snapshot.

py-lmdb touches every page of a value it returns; reading the pages here finds a value and its size
while touching only the B-tree pages and none of the value's. The format is LMDB 0.9's; the reader
refuses a liblmdb it does not know (:func:`check_lmdb_version`) rather than guess at its pages.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from pathlib import Path

import lmdb

from tierkv.tiers.disk.errors import DiskError
from tierkv.tiers.disk.mapping import PAGE

# liblmdb releases (major, minor) whose page format is the one below (MDB_DATA_VERSION 1).
KNOWN_LMDB = ((0, 9),)


def check_lmdb_version() -> tuple[int, int, int]:
    """The liblmdb version py-lmdb runs, if its page format is one this reader knows.

    Raises:
        DiskError: an unknown liblmdb (its pages may not be laid out as this reader expects).
    """
    major, minor, patch = lmdb.version()
    version = (int(major), int(minor), int(patch))
    if version[:2] not in KNOWN_LMDB:
        known = ", ".join(f"{a}.{b}.x" for a, b in KNOWN_LMDB)
        raise DiskError(f"liblmdb {'.'.join(map(str, version))} (py-lmdb {lmdb.__version__}) is not a version "
                        f"the disk tier's page reader knows ({known}); install an lmdb package that bundles one")
    return version


# LMDB 0.9 on-disk format (mdb.c), 64-bit little-endian: a page starts with pgno u64, pad u16, flags u16,
# lower u16, upper u16 (an overflow page: page count u32 instead of lower/upper), then u16 node offsets.
# A node: size (or child pgno) low u32, flags u16 (a branch: child pgno bits 32-47), key size u16, key,
# data. Meta pages 0 and 1 hold magic, version, address, map size, the free and main DB records (48 B:
# pad u32 = page size for the free DB, flags u16, depth u16, branch/leaf/overflow pages, entries, root)
# and the last page number and transaction id.
PAGE_HDR = struct.Struct("<QHHHH")
NODE_HDR = struct.Struct("<IHH")
META = struct.Struct("<II8x8x" + "IHH5Q" * 2 + "QQ")
MDB_MAGIC, MDB_VERSION = 0xBEEFC0DE, 1
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_LEAF2 = 0x01, 0x02, 0x04, 0x20
_F_BIGDATA = 0x01
_P_INVALID = (1 << 64) - 1
_DUPSORT = 0x04


class PageMap:
    """LMDB's pages seen through the tier's own read-only MADV_RANDOM mapping of the data file: walk or
    search the B-tree of one snapshot and hand out values as slices, touching no value page.

    Callers hold a read transaction of the snapshot, so LMDB reuses none of its pages meanwhile. Every
    page is checked (its number, its kind, bounds; an overflow page must hold its value); anything
    unexpected raises ValueError and the caller goes through py-lmdb instead.
    """

    def __init__(self, path: Path) -> None:
        self.lmdb_version = check_lmdb_version()
        self.path = path
        self._lock = threading.Lock()
        self._state: tuple[memoryview, int] | None = None  # (view of the mapping, its pages): one object

    def _map(self, need_pages: int = 0) -> tuple[memoryview, int]:
        """The mapping (remapped when the file grew past it), as a view and a page count."""
        state = self._state
        if state is not None and need_pages <= state[1]:
            return state
        with self._lock:
            state = self._state
            if state is not None and need_pages <= state[1]:
                return state
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                size = os.fstat(fd).st_size // PAGE * PAGE
                if size < 2 * PAGE:
                    raise ValueError("no LMDB meta pages yet")
                area = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            area.madvise(mmap.MADV_RANDOM)
            # The old mapping goes when the last value sliced from it does (no explicit close).
            self._state = (memoryview(area), size // PAGE)
            return self._state

    def _root(self, txnid: int) -> tuple[memoryview, int, int, int]:
        """(view, page count, main DB root, entries) of the snapshot ``txnid``."""
        view, pages = self._map()
        for pg in (0, 1):
            (magic, version, psize, _ff, _fd, _fb, _fl, _fo, _fe, _fr, _pad, flags, _depth, _b, _l, _o, entries,
             root, last, mtxn) = META.unpack_from(view, pg * PAGE + PAGE_HDR.size)
            if magic != MDB_MAGIC or version != MDB_VERSION or mtxn != txnid:
                continue
            if psize != PAGE or flags & _DUPSORT:
                raise ValueError(f"unexpected page size {psize} or DB flags {flags:#x}")
            if last >= pages:
                view, pages = self._map(last + 1)
            return view, pages, root, entries
        raise ValueError(f"no meta page of transaction {txnid}")

    @staticmethod
    def _page(view: memoryview, pages: int, pgno: int) -> tuple[int, int, int, tuple[int, ...]]:
        """(base offset, flags, upper, node offsets) of a branch or leaf page."""
        if not 2 <= pgno < pages:
            raise ValueError(f"page {pgno} outside the file")
        base = pgno * PAGE
        got, _pad, pflags, lower, upper = PAGE_HDR.unpack_from(view, base)
        if got != pgno or pflags & _P_LEAF2 or not pflags & (_P_BRANCH | _P_LEAF) or not (
                PAGE_HDR.size <= lower <= upper <= PAGE):
            raise ValueError(f"page {pgno}: not a branch or leaf page")
        ptrs = struct.unpack_from(f"<{(lower - PAGE_HDR.size) // 2}H", view, base + PAGE_HDR.size)
        if any(not upper <= ptr <= PAGE - NODE_HDR.size for ptr in ptrs):
            raise ValueError(f"page {pgno}: node offset out of bounds")
        return base, pflags, upper, ptrs

    @staticmethod
    def _key(view: memoryview, base: int, ptr: int) -> bytes:
        _lo, _flags, ksize = NODE_HDR.unpack_from(view, base + ptr)
        start = base + ptr + NODE_HDR.size
        if start + ksize > base + PAGE:
            raise ValueError("node key out of bounds")
        return bytes(view[start:start + ksize])

    @staticmethod
    def _value(view: memoryview, pages: int, base: int, ptr: int) -> tuple[int, int]:
        """(offset, size) of a leaf node's value."""
        dsize, nflags, ksize = NODE_HDR.unpack_from(view, base + ptr)
        data = base + ptr + NODE_HDR.size + ksize
        if nflags & _F_BIGDATA:
            (opg,) = struct.unpack_from("<Q", view, data)
            if not 2 <= opg < pages:
                raise ValueError(f"overflow page {opg} outside the file")
            got, _pad, oflags, opages = struct.unpack_from("<QHHI", view, opg * PAGE)
            if got != opg or not oflags & _P_OVERFLOW or opages * PAGE < PAGE_HDR.size + dsize or (
                    opg + opages > pages):
                raise ValueError(f"page {opg}: not an overflow page holding {dsize} B")
            return opg * PAGE + PAGE_HDR.size, dsize
        if nflags:
            raise ValueError(f"unexpected node flags {nflags:#x}")
        if data + dsize > base + PAGE:
            raise ValueError("inline value out of bounds")
        return data, dsize

    def walk(self, txnid: int) -> tuple[memoryview, list[tuple[bytes, int, int]]]:
        """The mapping and every (key, value offset, value size) of the snapshot, in key order."""
        view, pages, root, entries = self._root(txnid)
        items: list[tuple[bytes, int, int]] = []
        stack = [] if root == _P_INVALID else [root]
        while stack:
            base, pflags, _upper, ptrs = self._page(view, pages, stack.pop())
            if pflags & _P_BRANCH:
                children = []
                for ptr in ptrs:
                    lo, nflags, _ksize = NODE_HDR.unpack_from(view, base + ptr)
                    children.append(lo | nflags << 32)
                stack.extend(reversed(children))  # depth first, in key order
                continue
            for ptr in ptrs:
                items.append((self._key(view, base, ptr), *self._value(view, pages, base, ptr)))
        if len(items) != entries:
            raise ValueError(f"walked {len(items)} entries, the snapshot has {entries}")
        return view, items

    def find(self, txnid: int, key: bytes) -> memoryview | None:
        """The value of ``key`` in the snapshot (a slice of the mapping), None when absent."""
        loc = self.locate(txnid, key)
        return None if loc is None else loc[0][loc[1]:loc[1] + loc[2]]

    def locate(self, txnid: int, key: bytes) -> tuple[memoryview, int, int] | None:
        """(mapping, value offset, value size) of ``key`` in the snapshot, None when absent. LMDB orders
        keys as Python orders bytes (memcmp, then length); a branch node's first key is empty."""
        view, pages, pgno, _entries = self._root(txnid)
        if pgno == _P_INVALID:
            return None
        for _depth in range(64):
            base, pflags, _upper, ptrs = self._page(view, pages, pgno)
            if pflags & _P_BRANCH:
                lo, hi = 1, len(ptrs)  # child = the last node whose key <= key (node 0: minus infinity)
                while lo < hi:
                    mid = (lo + hi) // 2
                    if self._key(view, base, ptrs[mid]) <= key:
                        lo = mid + 1
                    else:
                        hi = mid
                node, nflags, _ksize = NODE_HDR.unpack_from(view, base + ptrs[lo - 1])
                pgno = node | nflags << 32
                continue
            lo, hi = 0, len(ptrs)
            while lo < hi:
                mid = (lo + hi) // 2
                if self._key(view, base, ptrs[mid]) < key:
                    lo = mid + 1
                else:
                    hi = mid
            if lo == len(ptrs) or self._key(view, base, ptrs[lo]) != key:
                return None
            off, size = self._value(view, pages, base, ptrs[lo])
            return view, off, size
        raise ValueError("B-tree deeper than 64 levels")

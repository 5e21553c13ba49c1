"""Disk tier: one LMDB environment in the data directory, opened only by the daemon, one writer.

Values are encoded block containers (``tierkv.codecs``): a header with format version, namespace
fingerprint, codec, raw length and a checksum of the raw bytes, then the payload. The LMDB key is
``fingerprint + block key``. Every read is verified; a bad value is reported as ``None`` (a miss).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from ..errors import PermissionDenied, TierFull, TierKVError

log = logging.getLogger("tierkv.disk")

PAGE = 4096
# LMDB needs room beyond the payload bytes (branch pages, free-list, copy-on-write of the last txn).
MAP_OVERHEAD = 1.25
MAP_EXTRA = 64 << 20
# The data file is preallocated this far ahead of LMDB's last page: extending a file inside an fsynced
# transaction costs ext4 block allocation and journal work (measured: 0.4 vs 1.0-1.6 GB/s commits).
GROW_AHEAD = 1 << 30
_MADV_WILLNEED = 3
_MADV_POPULATE_READ = 22  # Linux 5.14+: fault a whole range in at once
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _willneed(value: memoryview) -> None:
    """Map a whole value before decoding it. LMDB maps with MADV_RANDOM, so a 2 MiB value would
    otherwise take ~500 separate page faults (measured: 0.4 vs 2.4 GB/s on a first read); one
    MADV_POPULATE_READ maps (and if needed reads) the range in one go. Older kernels: readahead hint."""
    if len(value) < 64 << 10:
        return
    addr = np.frombuffer(value, np.uint8).ctypes.data
    start = addr & ~(PAGE - 1)
    length = addr + len(value) - start
    if _libc.madvise(start, length, _MADV_POPULATE_READ) != 0:
        _libc.madvise(start, length, _MADV_WILLNEED)


class DiskError(TierKVError):
    """The disk failed (EIO and friends): the tier is degraded."""

    code = "disk"


def stored_size(nbytes: int) -> int:
    """Bytes a value occupies in LMDB's overflow pages (whole pages plus the page header)."""
    return (nbytes + 16 + PAGE - 1) // PAGE * PAGE


class DiskTier:
    """The LMDB environment. Thread-safe: LMDB serialises writers; readers run in parallel."""

    def __init__(self, path: Path, capacity: int, sync: bool = True) -> None:
        self.path = Path(path)
        self.capacity = capacity
        self.map_size = int(capacity * MAP_OVERHEAD) + MAP_EXTRA
        self.sync = sync
        _private_env_dir(self.path)
        # writemap stays off: with writemap a full disk turns into SIGBUS instead of an error.
        self.env = lmdb.open(str(self.path), map_size=self.map_size, subdir=True, sync=sync, metasync=sync,
                             writemap=False, map_async=False, readahead=False, meminit=False, max_readers=256,
                             max_dbs=0, lock=True, mode=0o600)
        # Readers of processes killed mid-read leave stale slots; clear them at every start.
        self.env.reader_check()
        self._write_lock = threading.Lock()
        self._allocated = self.file_bytes()
        self.fault: Callable[[str], None] | None = None  # test shim: raise OSError(EIO) on "read"/"write"

    def scan(self) -> Iterator[tuple[bytes, memoryview]]:
        """Every (key, value) pair of one snapshot; values are only valid during iteration.

        Values are slices of a private read-only mapping of the data file (MADV_RANDOM), located by
        walking LMDB's B-tree pages (:func:`_walk_lmdb`): reading a value's header reads only the page
        it starts on. py-lmdb's own cursors touch every page of every value they return (its
        ``preload``), so a scan through them read the whole file at every start and left it all in the
        page cache (measured: a 512 MiB tier 100% resident after the start-up scan). If the walk meets
        anything it does not expect, the scan falls back to py-lmdb's cursor.
        """
        with self.env.begin(buffers=True) as txn:
            walked = None
            try:
                walked = _walk_lmdb(self.path / "data.mdb", txn.id())
            except (OSError, ValueError, struct.error) as exc:
                log.warning("disk scan: page walk failed (%s); reading values through LMDB", exc)
            if walked is None:
                for key, value in txn.cursor():
                    yield bytes(key), value
                return
            area, items = walked
            whole = memoryview(area)
            for key, off, size in items:
                yield key, whole[off:off + size]

    def write(self, puts: list[tuple[bytes, Any]], deletes: list[bytes] = ()) -> None:
        """Delete then put in one transaction, committed (and synced) before returning.

        Raises:
            TierFull: the map or the file system is full (nothing of this batch is written).
            DiskError: an I/O error (nothing of this batch is written).
        """
        with self._write_lock:
            try:
                if self.fault:
                    self.fault("write")
                self._grow(sum(len(v) for _, v in puts))
                with self.env.begin(write=True) as txn:
                    for key in deletes:
                        txn.delete(key)
                    for key, value in puts:
                        txn.put(key, value, overwrite=True)
            except lmdb.MapFullError:
                raise TierFull("disk tier map is full") from None
            except lmdb.Error as exc:
                raise _classify(exc) from None
            except OSError as exc:
                raise _classify(exc) from None

    def _grow(self, incoming: int) -> None:
        """Preallocate the data file ahead of the pages LMDB will use next.

        The step ahead is generous; on a file system without that much room it falls back to what this
        write needs, so a tier larger than its file system still fills the file system.
        """
        used = self.env.info()["last_pgno"] * PAGE
        need = used + 2 * incoming + (16 << 20)
        if need <= self._allocated:
            return
        target = min(self.map_size, max(need, self._allocated + min(GROW_AHEAD, self.map_size // 4)))
        tight = min(self.map_size, used + incoming + (1 << 20))
        fd = os.open(self.path / "data.mdb", os.O_RDWR | os.O_NOFOLLOW)
        try:
            for size in dict.fromkeys((target, min(need, self.map_size), tight)):
                if size <= self._allocated:
                    return
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or size == tight:
                        raise _classify(exc) from None
                    continue
                self._allocated = size
                return
        finally:
            os.close(fd)

    def delete(self, keys: list[bytes]) -> None:
        """Remove keys (missing keys are ignored)."""
        if keys:
            self.write([], keys)

    def read(self, key: bytes, use: Callable[[memoryview], Any]) -> Any:
        """Call ``use(value)`` on the stored value inside a read transaction; None when absent.

        Raises:
            DiskError: the read failed with an I/O error.
        """
        try:
            if self.fault:
                self.fault("read")
            with self.env.begin(buffers=True) as txn:
                value = txn.get(key)
                if value is None:
                    return None
                _willneed(value)
                return use(value)
        except (lmdb.Error, OSError) as exc:
            raise _classify(exc) from None

    def file_bytes(self) -> int:
        """Size of the data file on disk."""
        try:
            return os.stat(self.path / "data.mdb").st_size
        except OSError:
            return 0

    def readers(self) -> int:
        """LMDB reader slots in use (for leak checks)."""
        text = self.env.readers()
        return max(0, len([ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("pid")]))

    def drop_page_cache(self) -> None:
        """Ask the kernel to drop cached pages of the data file (benchmarks of cold reads)."""
        fd = os.open(self.path / "data.mdb", os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Sync and close the environment."""
        try:
            self.env.sync(True)
        except lmdb.Error:
            pass
        self.env.close()


# LMDB 0.9 on-disk format (mdb.c), 64-bit little-endian: a page starts with pgno u64, pad u16, flags u16,
# lower u16, upper u16 (an overflow page: page count u32 instead of lower/upper), then u16 node offsets.
# A node: size (or child pgno) low u32, flags u16 (a branch: child pgno bits 32-47), key size u16, key,
# data. Meta pages 0 and 1 hold magic, version, address, map size, the free and main DB records (48 B:
# pad u32 = page size for the free DB, flags u16, depth u16, branch/leaf/overflow pages, entries, root)
# and the last page number and transaction id.
_PAGE_HDR = struct.Struct("<QHHHH")
_NODE_HDR = struct.Struct("<IHH")
_META = struct.Struct("<II8x8x" + "IHH5Q" * 2 + "QQ")
_MDB_MAGIC, _MDB_VERSION = 0xBEEFC0DE, 1
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_LEAF2 = 0x01, 0x02, 0x04, 0x20
_F_BIGDATA = 0x01
_P_INVALID = (1 << 64) - 1
_DUPSORT = 0x04


def _walk_lmdb(path: Path, txnid: int) -> tuple[mmap.mmap, list[tuple[bytes, int, int]]] | None:
    """Find every (key, value offset, value size) of the snapshot ``txnid`` in an LMDB data file by
    reading its B-tree pages through a read-only MADV_RANDOM mapping, without touching value pages.

    Every page is checked (its number, its kind, bounds; an overflow page must hold its value) and the
    entry count must equal the snapshot's. Returns None for an empty file; raises ValueError on anything
    unexpected (the caller then reads through LMDB). The caller holds a read transaction of ``txnid``,
    so no page of this snapshot is reused meanwhile.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if size < 2 * PAGE:
            return None
        area = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    area.madvise(mmap.MADV_RANDOM)
    metas = []
    for pg in (0, 1):
        off = pg * PAGE
        (magic, version, psize, free_flags, _fd, _fb, _fl, _fo, _fe, _fr, _pad, flags, depth, _b, _l, _o, entries,
         root, _last, mtxn) = _META.unpack_from(area, off + _PAGE_HDR.size)
        if magic == _MDB_MAGIC and version == _MDB_VERSION:
            metas.append((mtxn, psize, flags, entries, root))
    meta = [m for m in metas if m[0] == txnid]
    if not meta:
        raise ValueError(f"no meta page of transaction {txnid}")
    _txn, psize, flags, entries, root = meta[0]
    if psize != PAGE or flags & _DUPSORT:
        raise ValueError(f"unexpected page size {psize} or DB flags {flags:#x}")
    items: list[tuple[bytes, int, int]] = []
    if root == _P_INVALID:
        if entries:
            raise ValueError("empty tree with entries")
        return area, items
    npages = size // PAGE
    stack = [root]
    while stack:
        pgno = stack.pop()
        if not 2 <= pgno < npages:
            raise ValueError(f"page {pgno} outside the file")
        base = pgno * PAGE
        got, _pad, pflags, lower, upper = _PAGE_HDR.unpack_from(area, base)
        if got != pgno or pflags & _P_LEAF2 or not pflags & (_P_BRANCH | _P_LEAF) or not (
                _PAGE_HDR.size <= lower <= upper <= PAGE):
            raise ValueError(f"page {pgno}: not a branch or leaf page")
        ptrs = struct.unpack_from(f"<{(lower - _PAGE_HDR.size) // 2}H", area, base + _PAGE_HDR.size)
        if pflags & _P_BRANCH:
            children = []
            for ptr in ptrs:
                lo, nflags, _ksize = _NODE_HDR.unpack_from(area, base + ptr)
                children.append(lo | nflags << 32)
            stack.extend(reversed(children))  # depth first, in key order
            continue
        for ptr in ptrs:
            if not upper <= ptr <= PAGE - _NODE_HDR.size:
                raise ValueError(f"page {pgno}: node offset {ptr} out of bounds")
            dsize, nflags, ksize = _NODE_HDR.unpack_from(area, base + ptr)
            kstart = base + ptr + _NODE_HDR.size
            key = area[kstart:kstart + ksize]
            if nflags & _F_BIGDATA:
                (opg,) = struct.unpack_from("<Q", area, kstart + ksize)
                if not 2 <= opg < npages:
                    raise ValueError(f"overflow page {opg} outside the file")
                got, _pad, oflags, opages = struct.unpack_from("<QHHI", area, opg * PAGE)
                if got != opg or not oflags & _P_OVERFLOW or opages * PAGE < _PAGE_HDR.size + dsize or (
                        opg + opages > npages):
                    raise ValueError(f"page {opg}: not an overflow page holding {dsize} B")
                items.append((key, opg * PAGE + _PAGE_HDR.size, dsize))
            elif nflags:
                raise ValueError(f"page {pgno}: unexpected node flags {nflags:#x}")
            else:
                if kstart + ksize + dsize > base + PAGE:
                    raise ValueError(f"page {pgno}: inline value out of bounds")
                items.append((key, kstart + ksize, dsize))
    if len(items) != entries:
        raise ValueError(f"walked {len(items)} entries, the snapshot has {entries}")
    return area, items


def _private_env_dir(path: Path) -> None:
    """Create the environment's directory 0700, or check an existing one (and its files) as the daemon
    checks the data dir: not a symlink, ours, not writable by others; files made 0600."""
    if path.is_symlink():
        raise PermissionDenied(f"{path} is a symlink; refusing to use it")
    path.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionDenied(f"{path} must belong to uid {os.getuid()} and not be writable by others")
    for name in ("data.mdb", "lock.mdb"):
        f = path / name
        if f.is_symlink():
            raise PermissionDenied(f"{f} is a symlink; refusing to use it")
        if f.exists() and os.stat(f).st_mode & 0o077:
            os.chmod(f, 0o600)  # left readable by an older version or a copy


def _classify(exc: Exception) -> TierKVError:
    err = getattr(exc, "errno", None)
    text = str(exc)
    if err in (errno.ENOSPC, errno.EDQUOT) or "No space left" in text or "MDB_MAP_FULL" in text:
        return TierFull(f"disk tier is full: {text}")
    return DiskError(f"disk tier I/O error: {text}")

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
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from tierkv.core.errors import PermissionDenied, TierFull, TierKVError

log = logging.getLogger("tierkv.disk")

PAGE = 4096
# LMDB needs room beyond the payload bytes (branch pages, free-list, copy-on-write of the last txn).
MAP_OVERHEAD = 1.25
MAP_EXTRA = 64 << 20
# The data file is preallocated ahead of LMDB's last page: extending a file inside an fsynced
# transaction costs ext4 block allocation and journal work (measured: 0.4 vs 1.0-1.6 GB/s commits).
# The step doubles the file (so a tier holding little occupies little: a fixed 1 GiB-ahead step filled a
# CI disk with test tiers that held a few MiB each) between GROW_MIN and GROW_AHEAD.
GROW_MIN = 16 << 20
GROW_AHEAD = 1 << 30
_MADV_WILLNEED = 3
_MADV_DONTNEED = 4
_MADV_POPULATE_READ = 22  # Linux 5.14+: fault a whole range in at once
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
_SYNC_FILE_RANGE_WRITE = 2
# How often a commit in progress has the kernel start writing the pages it has written so far.
WRITEBACK_KICK_S = 0.0005


def _willneed(value: memoryview) -> None:
    """Read and map a whole value before decoding it. LMDB maps with MADV_RANDOM, so touching a 2 MiB
    value page by page takes ~500 page faults, each a 4 KiB read when the page is not cached. One
    MADV_WILLNEED starts the reads of the whole range at once (large I/Os; measured: 0.1 vs 1.3 GB/s from
    the device), then one MADV_POPULATE_READ (Linux 5.14+) maps it (measured: 0.4 vs 2.4 GB/s from the
    page cache)."""
    if len(value) < 64 << 10:
        return
    addr = np.frombuffer(value, np.uint8).ctypes.data
    start = addr & ~(PAGE - 1)
    length = addr + len(value) - start
    _libc.madvise(start, length, _MADV_WILLNEED)
    _libc.madvise(start, length, _MADV_POPULATE_READ)


# Values read in place through the tier's mapping stay mapped until this many bytes were read, then
# every page of the mapping is dropped from the process (the page cache keeps them). Without it the
# daemon's RSS grows with every page of the LMDB file it ever read (measured in the soak: +330 MB of
# file-backed RSS, rising for minutes): page cache counted as the daemon's memory. Dropping after every
# read instead cost warm (page-cache) raw reads ~10% (3.3-3.4 vs 3.5-4.1 GB/s): each read mapped its
# pages again.
MAPPED_BUDGET = 64 << 20
# What one key's B-tree walk or value header maps beside the page it faults: the kernel maps cached
# neighbours of a faulting page too (fault-around, 64 KiB by default), MADV_RANDOM or not.
FAULT_AROUND = 64 << 10
# ... and at least this often while the tier is used: B-tree pages (ours and LMDB's) fault back in
# after a drop, each mapping 64 KiB of cached values around it (measured in the soak: 5-20 MB of the
# file mapped again within 0.25 s, 1-5 MB within 50 ms; a drop and the faults after it cost well
# under 1% of a core).
MAPPED_DROP_S = 0.05


def _find_mapping(path: Path, size: int) -> int | None:
    """The address of this process's mapping of ``path`` that is ``size`` bytes long (LMDB maps its
    whole map size; py-lmdb does not say where), or None."""
    target = os.path.realpath(path)
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].strip() == target:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    if hi - lo == size:
                        return lo
    except OSError:
        pass
    return None


def _unmap_pages(value: memoryview) -> None:
    """Take the pages wholly inside ``value`` out of this process's mappings (MADV_DONTNEED on a shared
    read-only file mapping: the page cache keeps them, the next use maps them again)."""
    if len(value) < 64 << 10:
        return
    addr = np.frombuffer(value, np.uint8).ctypes.data
    start = (addr + PAGE - 1) & ~(PAGE - 1)
    end = (addr + len(value)) & ~(PAGE - 1)
    if end > start:
        _libc.madvise(start, end - start, _MADV_DONTNEED)


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
        # writemap stays off: with writemap a full disk turns into SIGBUS instead of an error (and its
        # page faults made durable puts 2.4x slower here). metasync off: a commit fsyncs its data pages
        # but not the meta page that publishes them (a system crash may undo the last commit, never
        # corrupt the file, and the next commit's fsync carries it); writers that acknowledge durability
        # call flush() once after their last commit (one fsync instead of one per commit).
        self.env = lmdb.open(str(self.path), map_size=self.map_size, subdir=True, sync=sync, metasync=False,
                             writemap=False, map_async=False, readahead=False, meminit=False, max_readers=256,
                             max_dbs=0, lock=True, mode=0o600)
        # Readers of processes killed mid-read leave stale slots; clear them at every start.
        self.env.reader_check()
        self._write_lock = threading.Lock()
        self._allocated = self.file_bytes()
        self._mapped_bytes = 0  # read in place or written since the mappings' pages were last dropped
        self._dropped_at = time.monotonic()
        self._env_map_size = (self.env.info()["map_size"] + PAGE - 1) & ~(PAGE - 1)
        self._env_map = _find_mapping(self.path / "data.mdb", self._env_map_size)  # LMDB's map of the file
        self.fault: Callable[[str], None] | None = None  # test shim: raise OSError(EIO) on "read"/"write"
        self._pages = _PageMap(self.path / "data.mdb")
        self._buffers = threading.local()  # per reader thread: the O_DIRECT read buffer
        try:
            self._direct_fd: int | None = os.open(self.path / "data.mdb", os.O_RDONLY | os.O_DIRECT | os.O_NOFOLLOW)
        except OSError:  # a file system without O_DIRECT (tmpfs): cold values go through the page cache
            self._direct_fd = None
        self._direct_fd0 = self._direct_fd  # closed by close()
        # Small values are copied out with pread: used in place they would map their pages and, by the
        # kernel's fault-around, 64 KiB of cached neighbours each.
        self._read_fd = os.open(self.path / "data.mdb", os.O_RDONLY | os.O_NOFOLLOW)
        self._writeback = _WritebackKicker(self._read_fd if sync else None)

    def scan(self) -> Iterator[tuple[bytes, memoryview]]:
        """Every (key, value) pair of one snapshot; values are only valid during iteration.

        Values are slices of the tier's own read-only MADV_RANDOM mapping of the data file, located by
        walking LMDB's B-tree pages (:class:`_PageMap`): reading a value's header reads only the page it
        starts on. py-lmdb's cursors touch every page of every value they return (its ``preload``), so a
        scan through them read the whole file at every start and left it all in the page cache
        (measured: a 512 MiB tier 100% resident after the start-up scan). If the walk meets anything it
        does not expect, the scan reads through py-lmdb's cursor instead.
        """
        with self.env.begin(buffers=True) as txn:
            walked = None
            try:
                walked = self._pages.walk(txn.id())
            except (OSError, ValueError, struct.error) as exc:
                log.warning("disk scan: page walk failed (%s); reading values through LMDB", exc)
            if walked is None:
                for key, value in txn.cursor():
                    yield bytes(key), value
                return
            whole, items = walked
            for key, off, size in items:
                yield key, whole[off:off + size]
            _unmap_pages(whole)  # the header and B-tree pages the scan touched (the page cache keeps them)

    def write(self, puts: list[tuple[bytes, Any]], deletes: list[bytes] = ()) -> None:
        """Delete then put in one transaction, committed before returning: its data pages are synced,
        and it is durable once :meth:`flush` returns (or the next write's commit does).

        Raises:
            TierFull: the map or the file system is full (nothing of this batch is written).
            DiskError: an I/O error (nothing of this batch is written).
        """
        with self._write_lock:
            try:
                if self.fault:
                    self.fault("write")
                self._grow(sum(len(v) for _, v in puts))
                txn = self.env.begin(write=True)
                try:
                    for key in deletes:
                        txn.delete(key)
                    for key, value in puts:
                        txn.put(key, value, overwrite=True)
                except BaseException:
                    txn.abort()
                    raise
                with self._writeback:
                    txn.commit()
                self._count_mapped(sum(len(v) for _, v in puts) + FAULT_AROUND * (len(puts) + len(deletes)))
            except lmdb.MapFullError:
                raise TierFull("disk tier map is full") from None
            except lmdb.Error as exc:
                raise _classify(exc) from None
            except OSError as exc:
                raise _classify(exc) from None

    def flush(self) -> None:
        """Make every committed write durable (the meta pages of commits since the last flush).

        Raises:
            DiskError: the sync failed.
        """
        if not self.sync:
            return
        with self._write_lock:
            try:
                self.env.sync(True)
            except (lmdb.Error, OSError) as exc:
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
        step = min(GROW_AHEAD, max(GROW_MIN, self._allocated))
        target = min(self.map_size, max(need, self._allocated + step))
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

        The tier's page map finds the value in LMDB's B-tree; a value in the page cache is used in place
        through its mapping, one that is not is read from the device with one O_DIRECT read, as ``dd
        iflag=direct`` reads (measured, random 2 MiB values: 1.5 GB/s, vs 1.0 through the page cache and
        0.1 for py-lmdb's ``get``, which touches the value page by page first). Should ``use`` fail on
        that copy, or the map not find the key, the value is read again through LMDB, which decides.

        Raises:
            DiskError: the read failed with an I/O error.
        """
        try:
            if self.fault:
                self.fault("read")
            with self.env.begin(buffers=True) as txn:
                try:
                    value, mapped = self._fetch(txn.id(), key)
                except (ValueError, struct.error) as exc:  # an I/O error (OSError) is the disk's: raised
                    log.debug("disk read: page map failed (%s); reading through LMDB", exc)
                    value, mapped = None, False
                if value is not None:
                    try:
                        return use(value)
                    except Exception:
                        log.debug("disk read: the value read by the page map failed; reading through LMDB")
                    finally:
                        if mapped:
                            self._count_mapped(len(value) + FAULT_AROUND)
                value = txn.get(key)
                if value is None:
                    return None
                _willneed(value)
                try:
                    return use(value)
                finally:
                    self._count_mapped(len(value) + FAULT_AROUND)  # LMDB's map: dropped on the same budget
        except (lmdb.Error, OSError) as exc:
            raise _classify(exc) from None

    def _count_mapped(self, nbytes: int) -> None:
        """Count bytes read or written; past MAPPED_BUDGET, or MAPPED_DROP_S after the last time, drop
        the pages of both mappings of the file from the process: the tier's own (values read in
        place) and LMDB's (the B-tree pages and the first page of every value it looked at, with the
        kernel's fault-around mapping their cached neighbours: measured 170 MB of a soak's daemon).
        LMDB never writes through its map (no writemap), so what it reads next is faulted in again
        from the page cache."""
        self._mapped_bytes += nbytes
        now = time.monotonic()
        if self._mapped_bytes < MAPPED_BUDGET and now - self._dropped_at < MAPPED_DROP_S:
            return
        self._mapped_bytes = 0
        self._dropped_at = now
        _unmap_pages(self._pages._map()[0])
        if self._env_map is not None:
            _libc.madvise(self._env_map, min(self._env_map_size, (self.file_bytes() + PAGE - 1) & ~(PAGE - 1)),
                          _MADV_DONTNEED)

    def _fetch(self, txnid: int, key: bytes) -> tuple[memoryview | None, bool]:
        """The value through the page map, and whether it is the file's mapping: in place when cached,
        else by O_DIRECT into a buffer of this thread (valid until its next read). None: not found (LMDB
        then has the last word)."""
        loc = self._pages.locate(txnid, key)
        if loc is None:
            return None, False
        view, off, size = loc
        if size < 64 << 10:  # the mapping starts at file offset 0
            data = os.pread(self._read_fd, size, off)
            if len(data) < size:
                raise ValueError(f"short read ({len(data)} of {size} B)")
            return memoryview(data), False
        if self._direct_fd is None or self._pages.resident(view, off, size):
            value = view[off:off + size]
            _willneed(value)
            return value, True
        start = off & ~(PAGE - 1)  # the overflow page: O_DIRECT wants aligned offsets and lengths
        length = (off + size - start + PAGE - 1) & ~(PAGE - 1)
        buf = getattr(self._buffers, "buf", None)
        if buf is None or len(buf) < length:
            buf = self._buffers.buf = mmap.mmap(-1, length)  # page-aligned
        try:
            got = os.preadv(self._direct_fd, [memoryview(buf)[:length]], start)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            log.info("disk reads: O_DIRECT refused (%s); cold values go through the page cache", exc)
            self._direct_fd = None  # kept open until close(): another reader may be using it
            value = view[off:off + size]
            _willneed(value)
            return value, True
        if got < off - start + size:
            raise ValueError(f"short direct read ({got} of {length} B)")
        return memoryview(buf)[off - start:off - start + size], False

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
        self._writeback.close()
        os.close(self._read_fd)
        for fd in {self._direct_fd, self._direct_fd0} - {None}:
            os.close(fd)
        self._direct_fd = self._direct_fd0 = None


class _WritebackKicker:
    """While a commit runs (``with kicker: txn.commit()``), a thread has the kernel start writing the
    file's dirty pages every WRITEBACK_KICK_S (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which starts
    writeback and waits for nothing).

    LMDB's commit copies the transaction's pages into the page cache, then fsyncs: the device idles
    while the copy runs, and the CPU while the fsync waits. Started early, the writes overlap the copy
    (measured, LMDB alone in the daemon's pattern: 1.09-1.14 vs 0.90-0.92 GB/s in alternating runs). The
    fsync at the end of the commit is unchanged, so what a commit makes durable is unchanged.
    """

    def __init__(self, fd: int | None) -> None:
        self._fd = fd  # the data file, owned by the tier (None: off)
        self._active = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _WritebackKicker:
        if self._fd is not None:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tierkv-disk-writeback", daemon=True)
                self._thread.start()
            self._active.set()
        return self

    def __exit__(self, *exc: object) -> None:
        self._active.clear()

    def _run(self) -> None:
        while not self._closed:
            if not self._active.wait(1.0):
                continue
            fd = self._fd
            if fd is None or _libc.sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE) != 0:
                if fd is not None:
                    log.info("disk writeback kick unavailable (errno %d); commits write at their fsync",
                             ctypes.get_errno())
                self._fd = None
                self._active.clear()
                return
            time.sleep(WRITEBACK_KICK_S)

    def close(self) -> None:
        self._closed = True
        self._active.set()
        if self._thread is not None:
            self._thread.join(2.0)
        self._fd = None


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


class _PageMap:
    """LMDB's pages seen through the tier's own read-only MADV_RANDOM mapping of the data file: walk or
    search the B-tree of one snapshot and hand out values as slices, touching no value page.

    Callers hold a read transaction of the snapshot, so LMDB reuses none of its pages meanwhile. Every
    page is checked (its number, its kind, bounds; an overflow page must hold its value); anything
    unexpected raises ValueError and the caller goes through py-lmdb instead.
    """

    def __init__(self, path: Path) -> None:
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
             root, last, mtxn) = _META.unpack_from(view, pg * PAGE + _PAGE_HDR.size)
            if magic != _MDB_MAGIC or version != _MDB_VERSION or mtxn != txnid:
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
        got, _pad, pflags, lower, upper = _PAGE_HDR.unpack_from(view, base)
        if got != pgno or pflags & _P_LEAF2 or not pflags & (_P_BRANCH | _P_LEAF) or not (
                _PAGE_HDR.size <= lower <= upper <= PAGE):
            raise ValueError(f"page {pgno}: not a branch or leaf page")
        ptrs = struct.unpack_from(f"<{(lower - _PAGE_HDR.size) // 2}H", view, base + _PAGE_HDR.size)
        if any(not upper <= ptr <= PAGE - _NODE_HDR.size for ptr in ptrs):
            raise ValueError(f"page {pgno}: node offset out of bounds")
        return base, pflags, upper, ptrs

    @staticmethod
    def _key(view: memoryview, base: int, ptr: int) -> bytes:
        _lo, _flags, ksize = _NODE_HDR.unpack_from(view, base + ptr)
        start = base + ptr + _NODE_HDR.size
        if start + ksize > base + PAGE:
            raise ValueError("node key out of bounds")
        return bytes(view[start:start + ksize])

    @staticmethod
    def _value(view: memoryview, pages: int, base: int, ptr: int) -> tuple[int, int]:
        """(offset, size) of a leaf node's value."""
        dsize, nflags, ksize = _NODE_HDR.unpack_from(view, base + ptr)
        data = base + ptr + _NODE_HDR.size + ksize
        if nflags & _F_BIGDATA:
            (opg,) = struct.unpack_from("<Q", view, data)
            if not 2 <= opg < pages:
                raise ValueError(f"overflow page {opg} outside the file")
            got, _pad, oflags, opages = struct.unpack_from("<QHHI", view, opg * PAGE)
            if got != opg or not oflags & _P_OVERFLOW or opages * PAGE < _PAGE_HDR.size + dsize or (
                    opg + opages > pages):
                raise ValueError(f"page {opg}: not an overflow page holding {dsize} B")
            return opg * PAGE + _PAGE_HDR.size, dsize
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
                    lo, nflags, _ksize = _NODE_HDR.unpack_from(view, base + ptr)
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
                node, nflags, _ksize = _NODE_HDR.unpack_from(view, base + ptrs[lo - 1])
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

    def resident(self, view: memoryview, off: int, size: int) -> bool:
        """Whether every page of ``view[off:off + size]`` is in the page cache (mincore)."""
        addr = np.frombuffer(view, np.uint8, size, off).ctypes.data
        start = addr & ~(PAGE - 1)
        length = addr + size - start
        vec = np.empty((length + PAGE - 1) // PAGE, np.uint8)
        if _libc.mincore(start, length, vec.ctypes.data) != 0:
            return False
        return bool((vec & 1).all())


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

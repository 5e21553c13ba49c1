"""The disk tier's LMDB environment: scan, read, write and flush, one writer, readers in parallel.

Values are encoded block containers (``tierkv.codecs``): a header with format version, namespace
fingerprint, codec, raw length and a checksum of the raw bytes, then the payload. The LMDB key is
``fingerprint + block key``. The tier stores bytes only; its callers encode and verify them.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lmdb

from tierkv.core.errors import PermissionDenied, TierFull
from tierkv.tiers.disk.errors import classify
from tierkv.tiers.disk.mapping import MADV_DONTNEED, PAGE, find_mapping, libc, resident, unmap_pages, willneed
from tierkv.tiers.disk.pagemap import PageMap
from tierkv.tiers.disk.writeback import WritebackKicker

log = logging.getLogger("tierkv.disk")

# LMDB needs room beyond the payload bytes (branch pages, free-list, copy-on-write of the last txn).
MAP_OVERHEAD = 1.25
MAP_EXTRA = 64 << 20
# The data file is preallocated ahead of LMDB's last page: extending a file inside an fsynced
# transaction costs ext4 block allocation and journal work (measured: 0.4 vs 1.0-1.6 GB/s commits).
# The step doubles the file between GROW_MIN and GROW_AHEAD, so a tier holding little occupies little
# (a fixed 1 GiB step ahead would fill a CI disk with test tiers of a few MiB each).
GROW_MIN = 16 << 20
GROW_AHEAD = 1 << 30
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


def stored_size(nbytes: int) -> int:
    """Bytes a value occupies in LMDB's overflow pages (whole pages plus the page header)."""
    return (nbytes + 16 + PAGE - 1) // PAGE * PAGE


class DiskTier:
    """The LMDB environment. Thread-safe: LMDB serialises writers; readers run in parallel.

    Args:
        path: the environment's directory (created 0700; refused if a symlink or writable by others).
        capacity: bytes of stored values; the LMDB map is sized from it.
        sync: fsync each commit's data pages (durable acknowledgements need it).

    Raises:
        PermissionDenied: ``path`` or its files are not the daemon's own.
        DiskError: py-lmdb runs a liblmdb whose page format the page reader does not know.
    """

    def __init__(self, path: Path, capacity: int, sync: bool = True) -> None:
        self.path = Path(path)
        self.capacity = capacity
        self.map_size = int(capacity * MAP_OVERHEAD) + MAP_EXTRA
        self.sync = sync
        _private_env_dir(self.path)
        # Before LMDB opens the file: the page map refuses a liblmdb whose pages it cannot read.
        self._pages = PageMap(self.path / "data.mdb")
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
        self._max_key = self.env.max_key_size()
        self._write_lock = threading.Lock()
        self._allocated = self.file_bytes()
        self._mapped_bytes = 0  # read in place or written since the mappings' pages were last dropped
        self._dropped_at = time.monotonic()
        self._env_map_size = (self.env.info()["map_size"] + PAGE - 1) & ~(PAGE - 1)
        self._env_map = find_mapping(self.path / "data.mdb", self._env_map_size)  # LMDB's map of the file
        self.fault: Callable[[str], None] | None = None  # test shim: raise OSError(EIO) on "read"/"write"
        self._buffers = threading.local()  # per reader thread: the O_DIRECT read buffer
        try:
            self._direct_fd: int | None = os.open(self.path / "data.mdb", os.O_RDONLY | os.O_DIRECT | os.O_NOFOLLOW)
        except OSError:  # a file system without O_DIRECT (tmpfs): cold values go through the page cache
            self._direct_fd = None
        self._direct_fd0 = self._direct_fd  # closed by close()
        # Small values are copied out with pread: used in place they would map their pages and, by the
        # kernel's fault-around, 64 KiB of cached neighbours each.
        self._read_fd = os.open(self.path / "data.mdb", os.O_RDONLY | os.O_NOFOLLOW)
        self._writeback = WritebackKicker(self._read_fd if sync else None)

    def scan(self) -> Iterator[tuple[bytes, memoryview]]:
        """Every (key, value) pair of one snapshot; values are only valid during iteration.

        Values are slices of the tier's own read-only MADV_RANDOM mapping of the data file, located by
        walking LMDB's B-tree pages (:class:`~tierkv.tiers.disk.pagemap.PageMap`): reading a value's header reads only the page it
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
                for raw, value in txn.cursor():
                    yield bytes(raw), value
                return
            whole, items = walked
            for key, off, size in items:
                yield key, whole[off:off + size]
            unmap_pages(whole)  # the header and B-tree pages the scan touched (the page cache keeps them)

    def write(self, puts: list[tuple[bytes, Any]], deletes: Sequence[bytes] = ()) -> None:
        """Delete then put in one transaction, committed before returning: its data pages are synced,
        and it is durable once :meth:`flush` returns (or the next write's commit does).

        Raises:
            ValueError: a key is empty or longer than LMDB's key limit (nothing is written).
            TierFull: the map or the file system is full (nothing of this batch is written).
            DiskError: an I/O error (nothing of this batch is written).
        """
        for key in deletes:
            self._check_key(key)
        for key, _ in puts:
            self._check_key(key)
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
                raise classify(exc) from None
            except OSError as exc:
                raise classify(exc) from None

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
                raise classify(exc) from None

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
                        raise classify(exc) from None
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
            ValueError: ``key`` is empty or longer than LMDB's key limit.
            DiskError: the read failed with an I/O error.
        """
        self._check_key(key)
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
                willneed(value)
                try:
                    return use(value)
                finally:
                    self._count_mapped(len(value) + FAULT_AROUND)  # LMDB's map: dropped on the same budget
        except (lmdb.Error, OSError) as exc:
            raise classify(exc) from None

    def _check_key(self, key: bytes) -> None:
        # LMDB answers a bad key size with an error that would read as the disk failing.
        if not 0 < len(key) <= self._max_key:
            raise ValueError(f"a disk tier key must be 1..{self._max_key} bytes, got {len(key)}")

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
        unmap_pages(self._pages._map()[0])
        if self._env_map is not None:
            libc.madvise(self._env_map, min(self._env_map_size, (self.file_bytes() + PAGE - 1) & ~(PAGE - 1)),
                          MADV_DONTNEED)

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
        if self._direct_fd is None or resident(view, off, size):
            value = view[off:off + size]
            willneed(value)
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
            willneed(value)
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
        for fd in {self._direct_fd, self._direct_fd0}:
            if fd is not None:
                os.close(fd)
        self._direct_fd = self._direct_fd0 = None


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


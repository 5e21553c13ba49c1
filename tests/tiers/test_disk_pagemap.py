"""The disk tier's own view of LMDB's pages (tierkv.tiers.disk.pagemap.PageMap): the start-up scan and reads
find values by walking the B-tree themselves, because py-lmdb touches every page of a value it returns.
Checked against py-lmdb on trees of every depth, inline and overflow values, and after deletes."""

from __future__ import annotations

import ctypes
import mmap
import os
import random
from pathlib import Path

import numpy as np
import pytest

from tierkv.tiers.disk import PAGE, DiskTier
from tierkv.tiers.disk import tier as disk_module

SIZES = [0, 1, 100, 1500, 2100, 4000, 9000, 70000]


def _fill(tier: DiskTier, n: int, seed: int) -> dict[bytes, bytes]:
    rng = random.Random(seed)
    ref: dict[bytes, bytes] = {}
    for lo in range(0, n, 500):
        puts = []
        for _ in range(lo, min(n, lo + 500)):
            key = rng.randbytes(16) + rng.randbytes(rng.choice([1, 8, 32, 100]))
            value = rng.randbytes(rng.choice(SIZES))
            puts.append((key, value))
            ref[key] = value
        gone = rng.sample(sorted(ref), min(len(ref), 40))
        puts = [(k, v) for k, v in puts if k not in gone]
        for k in gone:
            ref.pop(k)
        tier.write(puts, gone)
    tier.flush()
    return ref


@pytest.mark.parametrize("n", [0, 1, 60, 4000])
def test_scan_and_find_match_lmdb(tmp_path: Path, n: int) -> None:
    tier = DiskTier(tmp_path / "disk", 256 << 20)
    try:
        ref = _fill(tier, n, n)
        with tier.env.begin() as txn:
            through_lmdb = {bytes(k): bytes(v) for k, v in txn.cursor()}
            walked = tier._pages.walk(txn.id())  # the scan's fast path, not its fallback
            assert len(walked[1]) == len(ref)
            rng = random.Random(1)
            for key, value in ref.items():
                found = tier._pages.find(txn.id(), key)
                assert found is not None and bytes(found) == value
                for near in (key + b"\0", key[:-1], rng.randbytes(len(key))):
                    if near not in ref:
                        assert tier._pages.find(txn.id(), near) is None
        assert through_lmdb == ref
        assert {k: bytes(v) for k, v in tier.scan()} == ref
        for key, value in list(ref.items())[:200]:
            assert tier.read(key, bytes) == value
        assert tier.read(b"\x7f" * 20, bytes) is None
    finally:
        tier.close()


def test_a_snapshot_is_read_while_the_writer_moves_on(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "disk", 256 << 20)
    try:
        ref = _fill(tier, 300, 7)
        with tier.env.begin() as txn:
            old = txn.id()
            for i in range(3):  # later commits reuse free pages and rewrite both meta pages
                tier.write([(b"new%d" % i, os.urandom(9000))], list(ref)[i * 10:(i + 1) * 10])
            assert {bytes(k): bytes(v) for k, v in txn.cursor()} == ref
            with pytest.raises(ValueError):
                tier._pages.walk(old)  # its meta page is gone: the caller falls back to py-lmdb
        assert tier.read(b"new2", len) == 9000
    finally:
        tier.close()


def _resident(path: Path) -> int:
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    vec = np.zeros((size + PAGE - 1) // PAGE, np.uint8)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        view = np.frombuffer(m, np.uint8)
        assert libc.mincore(view.ctypes.data, size, vec.ctypes.data) == 0
        del view
    return int((vec & 1).sum()) * PAGE


def test_scan_reads_headers_only(tmp_path: Path) -> None:
    """Iterating values touches only the pages read: 40 values of 1 MiB stay out of the page cache."""
    tier = DiskTier(tmp_path / "disk", 256 << 20)
    tier.write([(b"k%03d" % i, os.urandom(1 << 20)) for i in range(40)])
    tier.close()
    data = tmp_path / "disk" / "data.mdb"
    fd = os.open(data, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if _resident(data) > 1 << 20:
        pytest.skip("the page cache kept the file (cannot drop it here)")
    tier = DiskTier(tmp_path / "disk", 256 << 20)
    try:
        seen = sum(bytes(v[:64]) != b"" for _k, v in tier.scan())
        assert seen == 40
        assert _resident(data) < 4 << 20  # headers and B-tree pages, not 40 MiB of values
        assert tier.read(b"k007", len) == 1 << 20
    finally:
        tier.close()


def _mapped_rss(name: str) -> int:
    """Bytes of this process's mappings of files called ``name`` that are resident (/proc/self/smaps)."""
    total, current = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                current = line.rstrip().endswith(name)
            elif current and line.startswith("Rss:"):
                total += int(head[1]) * 1024
    return total


def test_values_read_in_place_do_not_stay_mapped(tmp_path: Path, monkeypatch) -> None:
    """Reads use values in place through the tier's mapping, and the mapping's pages are dropped from
    the process every MAPPED_BUDGET bytes read: the daemon's RSS does not grow with every page of the
    file it ever read (the page cache keeps them)."""
    monkeypatch.setattr(disk_module, "MAPPED_BUDGET", 8 << 20)
    tier = DiskTier(tmp_path / "disk", 256 << 20)
    try:
        values = {b"v%03d" % i: os.urandom(1 << 20) for i in range(32)}
        tier.write(list(values.items()))
        tier.flush()
        peak = 0
        for _ in range(2):  # the second pass maps the pages again: reads stay correct
            for key, value in values.items():
                assert tier.read(key, bytes) == value
                peak = max(peak, _mapped_rss("data.mdb"))
        assert 1 << 20 < peak < 12 << 20  # in place (mapped), but never 32 MiB of values at once
        assert sum(1 for _ in tier.scan()) == 32
        assert _mapped_rss("data.mdb") < 2 << 20  # the scan drops what it touched
    finally:
        tier.close()


def test_lmdb_map_pages_are_dropped_too(tmp_path: Path, monkeypatch) -> None:
    """LMDB's own mapping of the file (B-tree pages, pages it reads) is dropped on the same budget."""
    monkeypatch.setattr(disk_module, "MAPPED_BUDGET", 8 << 20)
    tier = DiskTier(tmp_path / "disk", 256 << 20)
    try:
        assert tier._env_map is not None
        for r in range(6):
            keys = [b"r%d-%02d" % (r, i) for i in range(8)]
            tier.write([(k, os.urandom(1 << 20)) for k in keys])
            with tier.env.begin(buffers=True) as txn:
                for k in keys:
                    assert len(txn.get(k)) == 1 << 20  # touches every page of the value in LMDB's map
        assert _mapped_rss("data.mdb") < 16 << 20  # not the 48 MiB LMDB's reads mapped
    finally:
        tier.close()


def test_an_unknown_liblmdb_is_refused_before_lmdb_opens(tmp_path: Path, monkeypatch) -> None:
    """The page reader knows LMDB 0.9's page format only: another liblmdb is one clear error."""
    import lmdb

    from tierkv.tiers.disk import DiskError
    from tierkv.tiers.disk.pagemap import check_lmdb_version

    assert check_lmdb_version() == tuple(lmdb.version())
    monkeypatch.setattr(lmdb, "version", lambda: (1, 0, 0))
    with pytest.raises(DiskError, match=r"liblmdb 1\.0\.0 .* page reader knows \(0\.9\.x\)"):
        DiskTier(tmp_path / "disk", 64 << 20)
    assert not (tmp_path / "disk" / "data.mdb").exists()

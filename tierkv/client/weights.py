"""Digests of weight files, cheap enough to take at every engine start.

A ``sampled`` digest of a safetensors file covers its size, its whole header (every tensor's name, dtype,
shape and offsets) and three windows of every tensor's bytes (its start, middle and end, 4 KiB each; a
small tensor whole): an edit of any tensor's values changes it unless the edit misses all three
windows. Another file is digested from its size and 256 windows spread over it (whole below 64 MiB). A
``full`` digest reads every byte. Digests are kept in a small JSON file under the user's cache
directory, keyed by the file's real path, device, inode, size and mtime, so a restart, or a second
process of the same engine, reads no weights at all.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import xxhash

__all__ = ["MODES", "WEIGHT_SUFFIXES", "DigestCache", "file_digest", "weight_files", "weights_digest"]

log = logging.getLogger("tierkv.identity")

Mode = Literal["sampled", "full"]
MODES: tuple[str, ...] = ("sampled", "full")
# Files an engine loads weights from; a directory's other files (tokenizer, README, ...) never change K or V.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".msgpack", ".h5", ".npz")
WINDOW = 4096          # bytes of a tensor per sampled window
SPREAD_WINDOWS = 256   # windows over a file that is not safetensors
SPREAD_WINDOW = 16384
WHOLE_BELOW = 64 << 20  # a file that is not safetensors and smaller than this is read whole
CHUNK = 8 << 20
MAX_HEADER = 100 << 20  # safetensors' own limit on its JSON header
MAX_ENTRIES = 4096     # digests kept in the cache file


def weight_files(path: Path) -> list[Path]:
    """The weight files of a model directory (top level, sorted by name), or the file itself."""
    if path.is_file():
        return [path]
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        raise FileNotFoundError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {path}")
    return files


def _windows(size: int, begin: int, end: int) -> Iterator[tuple[int, int]]:
    """Start, middle and end windows of ``[begin, end)`` (the whole range when it is short)."""
    n = end - begin
    if n <= 3 * WINDOW:
        yield begin, n
        return
    for off in (begin, begin + (n - WINDOW) // 2, end - WINDOW):
        yield off, WINDOW


def _safetensors(fd: int, size: int, h: xxhash.xxh3_128) -> bool:
    """Digest a safetensors file's header and tensor windows into ``h``; False if it is not one."""
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        return False
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER or 8 + n > size:
        return False
    raw = os.pread(fd, n, 8)
    try:
        header = json.loads(raw)
    except ValueError:
        return False
    if not isinstance(header, dict):
        return False
    h.update(raw)
    base = 8 + n
    spans = sorted((int(t["data_offsets"][0]), int(t["data_offsets"][1])) for name, t in header.items()
                   if name != "__metadata__" and isinstance(t, dict) and "data_offsets" in t)
    for begin, end in spans:
        for off, length in _windows(size, base + begin, base + end):
            h.update(os.pread(fd, length, off))
    return True


def _spread(fd: int, size: int, h: xxhash.xxh3_128) -> None:
    """Digest windows spread evenly over a file."""
    step = max(1, (size - SPREAD_WINDOW) // (SPREAD_WINDOWS - 1))
    for i in range(SPREAD_WINDOWS):
        h.update(os.pread(fd, SPREAD_WINDOW, min(i * step, max(0, size - SPREAD_WINDOW))))


def _whole(fd: int, h: xxhash.xxh3_128) -> None:
    off = 0
    while chunk := os.pread(fd, CHUNK, off):
        h.update(chunk)
        off += len(chunk)


def _compute(path: Path, mode: Mode) -> str:
    h = xxhash.xxh3_128()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        h.update(f"tierkv/weights/v1|{mode}|{size}|".encode())
        if mode == "full":
            _whole(fd, h)
        elif _safetensors(fd, size, h):
            pass
        elif size < WHOLE_BELOW:
            _whole(fd, h)
        else:
            _spread(fd, size, h)
    finally:
        os.close(fd)
    return h.hexdigest()


class DigestCache:
    """Digests by the file's real path, device, inode, size and mtime, in one JSON file (``path``; None:
    nothing is kept). A cache that cannot be read or written is ignored: digests are then recomputed."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    @staticmethod
    def default() -> DigestCache:
        """``$TIERKV_CACHE_DIR`` or ``$XDG_CACHE_HOME/tierkv`` or ``~/.cache/tierkv``, file ``digests.json``."""
        base = os.environ.get("TIERKV_CACHE_DIR")
        if not base:
            xdg = os.environ.get("XDG_CACHE_HOME")
            base = str(Path(xdg) / "tierkv") if xdg else str(Path.home() / ".cache" / "tierkv")
        return DigestCache(Path(base) / "digests.json")

    def _load(self) -> dict[str, dict]:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, stamp: str) -> str | None:
        """The digest kept for ``stamp``, or None."""
        entry = self._load().get(stamp)
        return entry.get("digest") if isinstance(entry, dict) and isinstance(entry.get("digest"), str) else None

    def put(self, stamp: str, digest: str) -> None:
        """Keep ``digest`` for ``stamp`` (the file is replaced atomically; the oldest entries go first)."""
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            data = self._load()
            data.pop(stamp, None)
            data[stamp] = {"digest": digest}
            while len(data) > MAX_ENTRIES:
                data.pop(next(iter(data)))
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".digests.")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.debug("tierkv: cannot keep weight digests in %s (%s)", self.path, exc)


def _stamp(path: Path, mode: Mode) -> str:
    st = os.stat(path)
    return f"{os.path.realpath(path)}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{mode}"


def file_digest(path: str | os.PathLike[str], mode: Mode = "sampled", cache: DigestCache | None = None) -> str:
    """The digest of one weight file (32 hex characters).

    Args:
        path: the file.
        mode: ``sampled`` (header, sizes and windows of every tensor) or ``full`` (every byte).
        cache: where digests are kept (default :meth:`DigestCache.default`).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    p = Path(path)
    cache = cache if cache is not None else DigestCache.default()
    stamp = _stamp(p, mode)
    digest = cache.get(stamp)
    if digest is None:
        digest = _compute(p, mode)
        if _stamp(p, mode) == stamp:  # unchanged while it was read
            cache.put(stamp, digest)
    return digest


def weights_digest(path: str | os.PathLike[str], mode: Mode = "sampled", cache: DigestCache | None = None) -> str:
    """The digest of a model's weights: its weight files' names (relative to the directory) and digests.

    Args:
        path: a model directory, or one weight file (a GGUF, say).
        mode: as for :func:`file_digest`.
        cache: as for :func:`file_digest`.

    Raises:
        FileNotFoundError: no such path, or a directory without weight files.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no such file or directory: {p}")
    h = xxhash.xxh3_128(b"tierkv/model-weights/v1")
    for f in weight_files(p):
        h.update(f"|{f.name}={file_digest(f, mode, cache)}".encode())
    return h.hexdigest()

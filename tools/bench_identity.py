#!/usr/bin/env python3
"""What a model's identity costs at engine start: the weight digest of a multi-GB safetensors file.

Writes a safetensors file of ``--gib`` GiB shaped like a transformer checkpoint (``--layers`` layers of
attention and MLP matrices, float16), drops it from the page cache (``posix_fadvise(DONTNEED)``) before
each cold run, and times:

* ``sampled``: the default digest (header, sizes, three 4 KiB windows of every tensor), cold;
* ``sampled, kept``: the same call again, answered from the digest kept by path, size and mtime;
* ``full``: every byte through xxh3-128, cold;
* ``read``: every byte read and thrown away, cold (the reference: what reading the weights costs).

    python tools/bench_identity.py --gib 4
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tierkv.client.weights import CHUNK, DigestCache, file_digest  # noqa: E402


def write_checkpoint(path: Path, gib: float, layers: int) -> tuple[int, int]:
    """A float16 safetensors file of about ``gib`` GiB: per layer q, k, v, o and three MLP matrices."""
    per_layer = int(gib * (1 << 30)) // layers
    hidden = int((per_layer / 2 / 10) ** 0.5) // 64 * 64  # 4 h^2 attention + 3 * 2 h^2 MLP = 10 h^2 elements
    shapes = {}
    for i in range(layers):
        for name, (r, c) in {"q": (hidden, hidden), "k": (hidden, hidden), "v": (hidden, hidden),
                             "o": (hidden, hidden), "gate": (2 * hidden, hidden), "up": (2 * hidden, hidden),
                             "down": (hidden, 2 * hidden)}.items():
            shapes[f"model.layers.{i}.{name}.weight"] = (r, c)
    header, off = {}, 0
    for name, (r, c) in shapes.items():
        n = r * c * 2
        header[name] = {"dtype": "F16", "shape": [r, c], "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    block = os.urandom(CHUNK)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        left = off
        while left:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    return len(shapes), 8 + len(raw) + off


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_all(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(CHUNK):
            pass


def timed(fn, path: Path, cold: bool = True) -> float:
    if cold:
        drop_cache(path)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the file is written (default: a temporary folder)")
    ap.add_argument("--out", default="bench-results/bench_identity.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "model.safetensors"
        tensors, size = write_checkpoint(path, args.gib, args.layers)
        rows: dict[str, list[float]] = {"sampled": [], "sampled, kept": [], "full": [], "read": []}
        nocache, kept = DigestCache(None), DigestCache(Path(tmp) / "digests.json")
        file_digest(path, "sampled", kept)
        for _ in range(args.runs):
            rows["sampled"].append(timed(lambda: file_digest(path, "sampled", nocache), path))
            rows["sampled, kept"].append(timed(lambda: file_digest(path, "sampled", kept), path, cold=False))
            rows["full"].append(timed(lambda: file_digest(path, "full", nocache), path))
            rows["read"].append(timed(lambda: read_all(path), path))
    med = {k: sorted(v)[len(v) // 2] for k, v in rows.items()}
    print(f"weights digest of one {size / (1 << 30):.2f} GiB safetensors file, {tensors} tensors "
          f"(median of {args.runs}, cold page cache except 'kept'):")
    print(f"  {'':16} {'ms':>10} {'/ read':>10}")
    for k in rows:
        print(f"  {k:16} {med[k] * 1e3:>10.3f} {med[k] / med['read']:>9.5f}x")
    print(f"  read: {size / med['read'] / 1e9:.2f} GB/s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bytes": size, "tensors": tensors, "runs": rows, "median_s": med}, indent=1))


if __name__ == "__main__":
    main()

"""zstd stage shared by every codec: thread-local contexts, section packing, guarded decompression.

zstandard's compressor and decompressor objects are not thread-safe, so each worker thread keeps its
own (``threading.local``); their calls release the GIL, so encode/decode scale with threads.
"""

from __future__ import annotations

import threading
from enum import IntEnum
from typing import Any

import zstandard

from tierkv.codecs.container import CodecError

_local = threading.local()

# Probe size for sections that usually do not compress (mantissa planes, quantized codes).
PROBE_BYTES = 4096
# A section is kept compressed only when zstd saves at least 1/32 (3%) of it; otherwise storing it raw
# makes decoding a memcpy.
_MIN_SAVING_SHIFT = 5


class Method(IntEnum):
    """How one section is stored."""

    RAW = 0
    ZSTD = 1


class Policy(IntEnum):
    """What the zstd stage should try for one section when encoding."""

    RAW = 0  # never compress
    FORCE = 1  # always compress, even if larger (the plain ``zstd`` reference codec)
    TRY = 2  # compress; keep it only if it saves >= 3%
    PROBE = 3  # compress a 4 KiB sample first; go on as TRY only if the sample shrinks by >= 10%


def _fast_params() -> zstandard.ZstdCompressionParameters:
    # "Level 1" of the byte-plane codec: the smallest match finder (hash_log 6, min_match 7), so nearly
    # everything is a Huffman-coded literal. Byte planes of floats have few long repeats but a skewed
    # byte histogram: this reaches the order-0 entropy of the exponent plane (1% better than zstd's own
    # level 1) at about 3x its speed on that plane (measured on the kv-sample; docs/design.md, Codecs).
    return zstandard.ZstdCompressionParameters(
        window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7, target_length=0,
        strategy=zstandard.STRATEGY_FAST, write_content_size=True, write_checksum=False, write_dict_id=False)


def compressor(level: int, *, tuned: bool) -> zstandard.ZstdCompressor:
    """This thread's compressor for ``level`` (``tuned``: the byte-plane profile at level 1)."""
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    key = (level, tuned and level == 1)
    cctx = cache.get(key)
    if cctx is None:
        if key[1]:
            cctx = zstandard.ZstdCompressor(compression_params=_fast_params())
        else:
            cctx = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False,
                                            write_dict_id=False)
        cache[key] = cctx
    return cctx


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def check_level(level: int) -> int:
    """Validate a zstd level (``ValueError`` if out of range)."""
    if not isinstance(level, int) or isinstance(level, bool):
        raise ValueError(f"level must be an int, got {level!r}")
    lo, hi = -7, zstandard.MAX_COMPRESSION_LEVEL
    if not lo <= level <= hi:
        raise ValueError(f"level {level} out of range [{lo}, {hi}]")
    return level


def pack_section(data: Any, policy: Policy, level: int, *, tuned: bool = True) -> tuple[Method, Any]:
    """Apply the zstd stage to one section.

    Args:
        data: a C-contiguous buffer (numpy array, bytes, memoryview).
        policy: what to try.
        level: zstd level; level 1 with ``tuned`` uses the byte-plane profile.

    Returns:
        ``(method, stored)`` where ``stored`` is ``data`` itself (RAW) or the zstd frame (ZSTD).
    """
    n = memoryview(data).nbytes
    if policy == Policy.RAW or n == 0:
        return Method.RAW, data
    cctx = compressor(level, tuned=tuned)
    if policy == Policy.PROBE and n > 2 * PROBE_BYTES:
        sample = memoryview(data).cast("B")[:PROBE_BYTES]
        if len(cctx.compress(sample)) * 10 > PROBE_BYTES * 9:
            return Method.RAW, data
    frame = cctx.compress(data)
    if policy == Policy.FORCE or len(frame) <= n - (n >> _MIN_SAVING_SHIFT):
        return Method.ZSTD, frame
    return Method.RAW, data


def check_frame(frame: bytes | memoryview, expected: int) -> None:
    """Validate a stored zstd section before decompressing it (``CodecError`` if it does not fit)."""
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as exc:
        raise CodecError(f"bad zstd frame header: {exc}") from None
    if params.content_size != expected:  # also rejects frames without a content size
        raise CodecError(f"zstd frame declares {params.content_size} bytes, expected {expected}")
    if params.dict_id:
        raise CodecError("zstd frame needs a dictionary")


def decompress_exact(frame: bytes | memoryview, expected: int) -> bytes:
    """Decompress one zstd frame that must hold exactly ``expected`` bytes.

    The frame header is checked first, so nothing larger than ``expected`` is ever allocated; trailing
    data and a frame shorter or longer than declared raise :class:`CodecError`.
    """
    check_frame(frame, expected)
    try:
        out = _decompressor().decompress(frame, max_output_size=expected, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CodecError(f"corrupt zstd section: {exc}") from None
    if len(out) != expected:
        raise CodecError(f"zstd section decoded to {len(out)} bytes, expected {expected}")
    return out

"""Encode and decode one block: the pipeline around the codecs.

Every function here is thread-safe and spends its heavy time in zstandard, numpy and xxhash, which
release the GIL (zstd contexts are per thread).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import xxhash

from tierkv.codecs.base import Codec
from tierkv.codecs.container import (
    FINGERPRINT_BYTES,
    SCOPE_RAW,
    CodecError,
    ForeignBlock,
    frame_hash,
    pack_header,
    pack_params,
)
from tierkv.codecs.header import read_header
from tierkv.codecs.registry import available_codecs, get_codec
from tierkv.codecs.zstdio import Method, check_level, decompress_exact, pack_section
from tierkv.core.errors import BadRequest
from tierkv.core.layout import Layout

# 'lossless' stores the block raw below this ratio (by element size): decoding raw is a memcpy. Of a
# 4-byte float only the sign/exponent byte compresses (about 1.2x a block), and the daemon read such
# blocks at 0.39 GB/s against 1.40 GB/s raw (docs/design.md, Codecs): a 32-bit block must save a fifth.
MIN_LOSSLESS_RATIO = {1: 1.1, 2: 1.1, 4: 1.25}


def _as_u8(buf: Any, nbytes: int, *, writable: bool, what: str) -> np.ndarray:
    """A flat uint8 numpy view of a C-contiguous buffer of exactly ``nbytes`` (no copy)."""
    torch = sys.modules.get("torch")  # a tensor can only exist if torch is already imported
    if torch is not None and isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise BadRequest(f"{what} must be a contiguous CPU tensor")
        arr = buf.detach().reshape(-1).view(torch.uint8).numpy()
    elif isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise BadRequest(f"{what} must be C-contiguous")
        arr = buf.reshape(-1).view(np.uint8)
    else:
        try:
            mv = memoryview(buf)
        except TypeError:
            raise BadRequest(f"{what} must be a buffer (bytes, memoryview, numpy array)") from None
        if not mv.c_contiguous:
            raise BadRequest(f"{what} must be C-contiguous")
        arr = np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=np.uint8)
    if arr.nbytes != nbytes:
        raise BadRequest(f"{what} has {arr.nbytes} bytes, the layout needs {nbytes}")
    if writable and not arr.flags.writeable:
        raise BadRequest(f"{what} is read-only")
    return arr


def _check_ids(fingerprint: Any, key: Any) -> tuple[bytes, bytes]:
    if not isinstance(fingerprint, (bytes, bytearray, memoryview)) or len(bytes(fingerprint)) != FINGERPRINT_BYTES:
        raise BadRequest(f"fingerprint must be {FINGERPRINT_BYTES} bytes")
    if not isinstance(key, (bytes, bytearray, memoryview)) or not bytes(key):
        raise BadRequest("key must be non-empty bytes")
    return bytes(fingerprint), bytes(key)


def _options_for(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Options of codec ``name`` (``int4_group`` -> ``group``); options of other codecs are ignored so
    that one tier config can hold settings for several codecs."""
    mine: dict[str, Any] = {}
    if not options:
        return mine
    others = tuple(f"{c}_" for c in available_codecs() if c != name)
    for k, v in options.items():
        if k.startswith(f"{name}_"):
            mine[k[len(name) + 1:]] = v
        elif not k.startswith(others):
            raise ValueError(f"unknown codec option {k!r} (options are prefixed by their codec: int4_group=32)")
    return mine


def _digest(parts: list[Any], fingerprint: bytes, key: bytes) -> bytes:
    h = xxhash.xxh3_128()
    for p in parts:
        h.update(p)
    h.update(fingerprint)  # fixed length, then the key last: no ambiguity between the two
    h.update(key)
    return h.digest()


def _encode(codec: Codec, raw: np.ndarray, layout: Layout, fingerprint: bytes, key: bytes,
            params: dict[str, Any], level: int, raw_digest: bytes | None) -> bytes:
    parts = codec.encode(raw, layout, params)
    if parts is None:  # a lossy codec that cannot take this block (non-finite values, integer dtype)
        codec = get_codec("lossless")
        params = {}
        parts = codec.encode(raw, layout, params)
        assert parts is not None  # the lossless codec takes every block
    packed = [pack_section(buf, policy, level, tuned=codec.name != "zstd") for buf, policy in parts]
    if codec.checksum_scope == SCOPE_RAW:
        digest = raw_digest if raw_digest is not None else _digest([raw], fingerprint, key)
    else:
        digest = _digest([buf for buf, _ in parts], fingerprint, key)
    table = [(int(m), memoryview(s).nbytes, memoryview(b).nbytes) for (m, s), (b, _) in zip(packed, parts)]
    frames = frame_hash([s for m, s in packed if m == Method.ZSTD])
    header = pack_header(codec_id=codec.codec_id, layout=layout, fingerprint=fingerprint, checksum=digest,
                         scope=codec.checksum_scope, params=pack_params(params), sections=table, frames=frames)
    stored = len(header) + sum(t[1] for t in table)
    if codec.name == "lossless" and stored * MIN_LOSSLESS_RATIO[layout.itemsize] > layout.block_bytes:
        return _encode(get_codec("raw"), raw, layout, fingerprint, key, {}, level, digest)
    return b"".join([header, *(s for _, s in packed)])


def encode_block(raw: Any, *, layout: Layout, fingerprint: bytes, key: bytes, codec: str = "lossless",
                 level: int = 1, **options: Any) -> bytes:
    """Encode one block into a self-describing container.

    Args:
        raw: a C-contiguous buffer (bytes, memoryview, numpy array or CPU tensor) of exactly
            ``layout.block_bytes`` holding one block ``[2, L, H, T, D]`` in ``layout.dtype``.
        layout: the block's layout.
        fingerprint: the namespace fingerprint (16 bytes); stored, and covered by the checksum.
        key: the block key; not stored, but covered by the checksum, so a blob copied under another key
            fails to decode.
        codec: one of :func:`available_codecs`. Lossy codecs store blocks with non-finite values, and
            blocks of non-float dtypes, with ``lossless`` instead.
        level: zstd level for the zstd stage (1: the tuned byte-plane profile; plain zstd level for ``zstd``).
        **options: codec options prefixed by the codec name, such as ``int4_int8_layers=2`` or
            ``lossless_channel_major=True``; options of other codecs are ignored.

    Returns:
        The encoded block.

    Raises:
        ValueError: unknown codec, bad option or level (``BadRequest`` for a wrong buffer size,
            fingerprint or key).
    """
    c = get_codec(codec)
    check_level(level)
    fp, k = _check_ids(fingerprint, key)
    u8 = _as_u8(raw, layout.block_bytes, writable=False, what="raw block")
    params = c.make_params(layout, _options_for(c.name, options))
    return _encode(c, u8, layout, fp, k, params, level, None)


def decode_block(blob: Any, *, layout: Layout, fingerprint: bytes, key: bytes, out: Any = None) -> Any:
    """Verify and decode one encoded block.

    Everything is checked before a buffer is allocated: header, namespace, layout, section sizes
    against the layout, zstd frame sizes, the frames' hash. The checksum over the decoded bytes, fingerprint and key is
    verified before returning.

    Args:
        blob: the encoded block (bytes-like).
        layout: the layout the caller expects; a blob of another layout is rejected.
        fingerprint: the caller's namespace fingerprint; a blob of another namespace is rejected.
        key: the key the blob was read under.
        out: optional writable C-contiguous buffer of ``layout.block_bytes`` to decode into; its content
            is unspecified when an error is raised.

    Returns:
        ``out`` if given, else a new uint8 numpy array of ``layout.block_bytes``.

    Raises:
        CodecError: the blob is corrupt, truncated, foreign, stored under another key or hostile.
        BadRequest: ``out``, ``fingerprint`` or ``key`` are unusable (caller misuse).
    """
    fp, k = _check_ids(fingerprint, key)
    target = None if out is None else _as_u8(out, layout.block_bytes, writable=True, what="out")
    h = read_header(blob)
    if h.fingerprint != fp:
        raise ForeignBlock("block belongs to another namespace (fingerprint mismatch)")
    if h.layout != layout.to_dict():
        raise CodecError(f"block layout {h.layout} does not match {layout.to_dict()}")
    codec = get_codec(h.codec)
    params = h.params  # validated by read_header, sizes included
    mv = memoryview(blob).cast("B")
    pieces = []
    off = h.header_len
    for s in h.sections:
        pieces.append(mv[off:off + s.stored_len])
        off += s.stored_len
    if h.frame_hash is not None and frame_hash([p for p, s in zip(pieces, h.sections)
                                                if s.method == "zstd"]) != h.frame_hash:
        raise CodecError("frame hash mismatch (a stored zstd section is corrupt)")
    bufs: list[Any] = [decompress_exact(p, s.decoded_len) if s.method == "zstd" else p
                       for p, s in zip(pieces, h.sections)]
    if codec.checksum_scope != SCOPE_RAW and _digest(bufs, fp, k) != h.checksum:
        raise CodecError("checksum mismatch (corrupt, or stored under another key)")
    result = target if target is not None else np.empty(layout.block_bytes, dtype=np.uint8)
    try:
        with np.errstate(all="ignore"):
            codec.decode(bufs, layout, params, result)
    except (ValueError, TypeError, IndexError, ArithmeticError) as exc:
        raise CodecError(f"{codec.name} payload could not be decoded: {exc}") from None
    if codec.checksum_scope == SCOPE_RAW and _digest([result], fp, k) != h.checksum:
        raise CodecError("checksum mismatch (corrupt, or stored under another key)")
    return out if out is not None else result


__all__ = ["Method", "decode_block", "encode_block"]

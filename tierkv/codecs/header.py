"""The header reader: parses an encoded block's header and validates it against the codec registry."""

from __future__ import annotations

from typing import Any

import xxhash

from tierkv.codecs.base import Codec
from tierkv.codecs.container import (
    _FIXED,
    _FRAME_HASH,
    _HASH,
    _METHODS,
    _MIN_FRAME,
    _SCOPES,
    _SECTION,
    DTYPE_NAMES,
    EARLIEST_READ,
    FORMAT_VERSION,
    KIND_NAMES,
    MAGIC,
    MAX_PARAMS_BYTES,
    MAX_SECTIONS,
    BlockHeader,
    CodecError,
    EarlierFormat,
    Section,
    _compress_bound,
    unpack_params,
)
from tierkv.codecs.registry import codec_by_id
from tierkv.core.layout import Layout


def read_header(blob: Any) -> BlockHeader:
    """Parse and validate the header of an encoded block.

    Checks the magic, version, header hash, known codec and dtype, a valid layout whose size is the
    declared raw length, canonical codec parameters, section sizes equal to what the codec derives
    from the layout, and that the section table accounts for exactly the rest of ``blob``.
    It does not decompress or verify the payload (``decode_block`` does).

    Args:
        blob: the whole encoded block (bytes-like).

    Returns:
        The validated header.

    Raises:
        CodecError: the header is malformed, truncated or inconsistent.
    """
    try:
        mv = memoryview(blob).cast("B")
    except (TypeError, ValueError):
        raise CodecError("encoded block must be a contiguous bytes-like object") from None
    total = mv.nbytes
    if total < _FIXED.size + _HASH.size:
        raise CodecError(f"truncated block header ({total} B)")
    (magic, version, codec_id, dtype_id, scope, n_layers, n_heads, head_dim, block_tokens, raw_len,
     fingerprint, checksum, params_len, n_sections, kind_id) = _FIXED.unpack_from(mv, 0)
    header_len = _check_framing(mv, magic, version, params_len, n_sections)
    codec = codec_by_id(codec_id)
    if codec is None:
        raise CodecError(f"unknown codec id {codec_id}")
    layout = _check_layout(codec, dtype_id, scope, (n_layers, n_heads, head_dim, block_tokens), raw_len, kind_id)
    off = _FIXED.size
    params = codec.check_params(layout, unpack_params(bytes(mv[off:off + params_len])))
    sections = _read_sections(mv, off + params_len, n_sections)
    frames = _FRAME_HASH.unpack_from(mv, header_len - _HASH.size - _FRAME_HASH.size)[0] if version >= 3 else None
    expected = codec.section_sizes(layout, params)
    if [s.decoded_len for s in sections] != expected:
        raise CodecError(f"section sizes {[s.decoded_len for s in sections]} do not match the layout {expected}")
    if sum(s.stored_len for s in sections) != total - header_len:
        raise CodecError(f"section lengths do not match the payload ({total - header_len} B)")
    return BlockHeader(version=version, codec=codec.name, codec_id=codec_id, params=params, dtype=layout.dtype,
                       layout=layout.to_dict(), fingerprint=bytes(fingerprint), raw_len=raw_len, stored_len=total,
                       header_len=header_len, checksum=bytes(checksum), checksum_scope=_SCOPES[scope],
                       sections=tuple(sections), frame_hash=frames)


def _check_framing(mv: memoryview, magic: bytes, version: int, params_len: int, n_sections: int) -> int:
    """Check magic, declared sizes, the header hash and the version; return the header length. A value of
    a format this tierkv no longer reads (format 1; its header whole) is an :class:`EarlierFormat`; formats 1
    and 2 frame without the frame hash."""
    if magic != MAGIC:
        raise CodecError("not a tierkv block (bad magic)")
    if params_len > MAX_PARAMS_BYTES or n_sections > MAX_SECTIONS:
        raise CodecError("header declares too many parameters or sections")
    frames = _FRAME_HASH.size if version >= 3 else 0
    header_len = _FIXED.size + params_len + n_sections * _SECTION.size + frames + _HASH.size
    if mv.nbytes < header_len:
        raise CodecError(f"truncated block header ({mv.nbytes} B < {header_len} B)")
    (stored_hash,) = _HASH.unpack_from(mv, header_len - _HASH.size)
    if xxhash.xxh3_64_intdigest(mv[:header_len - _HASH.size]) != stored_hash:
        raise CodecError("block header hash mismatch")
    if 1 <= version < EARLIEST_READ:
        raise EarlierFormat(f"block of the earlier format {version} (this tierkv writes {FORMAT_VERSION})")
    if version > FORMAT_VERSION or version < 1:
        raise CodecError(f"unsupported block format version {version}")
    return header_len


def _check_layout(codec: Codec, dtype_id: int, scope: int, shape: tuple[int, int, int, int],
                  raw_len: int, kind_id: int = 0) -> Layout:
    """The header's layout, checked against its dtype, kind, raw length and the codec's checksum scope."""
    if dtype_id not in DTYPE_NAMES or scope not in _SCOPES or kind_id not in KIND_NAMES:
        raise CodecError("unknown dtype, layout kind or checksum scope")
    try:
        layout = Layout(*shape, DTYPE_NAMES[dtype_id], KIND_NAMES[kind_id])
    except ValueError as exc:
        raise CodecError(f"bad layout in header: {exc}") from None
    if raw_len != layout.block_bytes:
        raise CodecError(f"raw length {raw_len} does not match the layout ({layout.block_bytes} B)")
    if scope != codec.checksum_scope:
        raise CodecError("checksum scope does not match the codec")
    return layout


def _read_sections(mv: memoryview, off: int, n_sections: int) -> list[Section]:
    """The section table at ``off``, each entry checked for a known method and plausible lengths."""
    sections = []
    for i in range(n_sections):
        method, stored, decoded = _SECTION.unpack_from(mv, off + i * _SECTION.size)
        if method not in _METHODS:
            raise CodecError(f"unknown section method {method}")
        if method == 0 and stored != decoded:
            raise CodecError("raw section length mismatch")
        if method == 1 and not _MIN_FRAME <= stored <= _compress_bound(decoded):
            raise CodecError(f"zstd section of {stored} B cannot hold {decoded} B")
        sections.append(Section(_METHODS[method], stored, decoded))
    return sections

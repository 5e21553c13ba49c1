"""The block container: a self-describing header in front of the encoded sections.

Layout (little-endian)::

    fixed part   magic "TKVB", format version, codec id, dtype id, checksum scope,
                 num_layers, num_kv_heads, head_dim, block_tokens (u32 each), raw_len (u64),
                 namespace fingerprint (16 B), checksum (xxh3_128, 16 B), params_len (u16),
                 section count (u8), reserved (u8)
    params       msgpack map of the codec's parameters (params_len bytes, may be empty)
    sections     per section: method (u8: 0 raw, 1 zstd), stored_len (u32), decoded_len (u32)
    header hash  xxh3_64 of everything above (8 B)
    payload      the sections' stored bytes, back to back

The checksum covers the raw block (or, for lossy codecs, the decoded sections), then the namespace
fingerprint, then the block key; the key itself is not stored, so a value copied under another key
fails verification. The header hash lets a scan validate headers without decoding payloads.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
import xxhash

from tierkv.core.errors import TierKVError
from tierkv.core.layout import Layout

MAGIC = b"TKVB"
FORMAT_VERSION = 1
FINGERPRINT_BYTES = 16
MAX_PARAMS_BYTES = 512
MAX_SECTIONS = 16

_FIXED = struct.Struct("<4sBBBBIIIIQ16s16sHBB")
_SECTION = struct.Struct("<BII")
_HASH = struct.Struct("<Q")

# Ids are part of the on-disk format: never renumber, only append.
DTYPE_IDS: dict[str, int] = {"float32": 1, "float16": 2, "bfloat16": 3, "float8_e4m3fn": 4, "float8_e5m2": 5,
                             "int8": 6, "uint8": 7}
DTYPE_NAMES = {v: k for k, v in DTYPE_IDS.items()}
SCOPE_RAW = 1  # checksum over the raw block bytes
SCOPE_SECTIONS = 2  # checksum over the decoded sections (lossy codecs: the original is not recoverable)
_SCOPES = {SCOPE_RAW: "raw", SCOPE_SECTIONS: "sections"}
_METHODS = {0: "raw", 1: "zstd"}


_MIN_FRAME = 8  # magic, frame header descriptor, one block header


def _compress_bound(n: int) -> int:
    """ZSTD_COMPRESSBOUND: the largest frame zstd produces for ``n`` input bytes."""
    return n + (n >> 8) + (((128 << 10) - n) >> 11 if n < (128 << 10) else 0)


class CodecError(TierKVError):
    """A stored block is corrupt, truncated, foreign or hostile; treat it as a miss."""

    code = "corrupt"


@dataclass(frozen=True, slots=True)
class Section:
    """One stored section: ``method`` is ``"raw"`` or ``"zstd"``."""

    method: str
    stored_len: int
    decoded_len: int


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """The parsed, validated header of an encoded block.

    Attributes:
        version: container format version.
        codec: codec name (``"raw"``, ``"zstd"``, ``"lossless"``, ``"fp8"``, ``"int8"``, ``"int4"``).
        codec_id: the codec's numeric id.
        params: the codec's parameters as stored.
        dtype: canonical dtype name of the block.
        layout: the block's layout as a dict (:meth:`Layout.to_dict`).
        fingerprint: namespace fingerprint (16 bytes).
        raw_len: bytes of the decoded block.
        stored_len: bytes of the whole encoded blob (header + payload).
        header_len: bytes of the header.
        checksum: xxh3_128 digest (16 bytes).
        checksum_scope: ``"raw"`` (raw block bytes) or ``"sections"`` (decoded sections of a lossy codec).
        sections: the payload's sections in order.
    """

    version: int
    codec: str
    codec_id: int
    params: dict[str, Any]
    dtype: str
    layout: dict[str, Any]
    fingerprint: bytes
    raw_len: int
    stored_len: int
    header_len: int
    checksum: bytes
    checksum_scope: str
    sections: tuple[Section, ...] = field(default=())

    @property
    def payload_len(self) -> int:
        """Bytes after the header."""
        return self.stored_len - self.header_len

    @property
    def ratio(self) -> float:
        """raw_len / stored_len."""
        return self.raw_len / self.stored_len if self.stored_len else 0.0

    @property
    def lossy(self) -> bool:
        """Whether the codec does not reproduce the raw bytes exactly."""
        return self.checksum_scope != "raw"


def pack_params(params: dict[str, Any]) -> bytes:
    """Serialize codec parameters (empty dict -> empty bytes)."""
    if not params:
        return b""
    out = msgpack.packb(params, use_bin_type=True)
    if len(out) > MAX_PARAMS_BYTES:
        raise ValueError(f"codec parameters too large ({len(out)} B)")
    return out


def _unpack_params(data: bytes) -> dict[str, Any]:
    if not data:
        return {}
    try:
        params = msgpack.unpackb(data, raw=False, strict_map_key=True, max_str_len=64, max_bin_len=64,
                                 max_array_len=16, max_map_len=32, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise CodecError(f"bad codec parameters: {exc}") from None
    if not isinstance(params, dict) or not all(
            isinstance(v, (bool, int, float, str)) for v in params.values()):
        raise CodecError("bad codec parameters")
    return params


def pack_header(*, codec_id: int, layout: Layout, fingerprint: bytes, checksum: bytes, scope: int,
                params: bytes, sections: list[tuple[int, int, int]]) -> bytes:
    """Build the header bytes (fixed part, params, section table, header hash)."""
    head = bytearray(_FIXED.pack(MAGIC, FORMAT_VERSION, codec_id, DTYPE_IDS[layout.dtype], scope,
                                 layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_tokens,
                                 layout.block_bytes, fingerprint, checksum, len(params), len(sections), 0))
    head += params
    for method, stored, decoded in sections:
        head += _SECTION.pack(method, stored, decoded)
    head += _HASH.pack(xxhash.xxh3_64_intdigest(head))
    return bytes(head)


def read_header(blob) -> BlockHeader:
    """Parse and validate the header of an encoded block.

    Checks the magic, version, header hash, known codec and dtype, a valid layout whose size is the
    declared raw length, canonical codec parameters, section sizes equal to what the codec derives
    from the layout, and that the section table accounts for exactly the rest of ``blob``.
    It does not decompress or verify the payload (``decode_block`` does).

    Args:
        blob: the whole encoded block (bytes-like).

    Raises:
        CodecError: the header is malformed, truncated or inconsistent.
    """
    from tierkv.codecs.registry import codec_by_id  # registry imports the codecs, which import this module

    try:
        mv = memoryview(blob).cast("B")
    except (TypeError, ValueError):
        raise CodecError("encoded block must be a contiguous bytes-like object") from None
    total = mv.nbytes
    if total < _FIXED.size + _HASH.size:
        raise CodecError(f"truncated block header ({total} B)")
    (magic, version, codec_id, dtype_id, scope, n_layers, n_heads, head_dim, block_tokens, raw_len,
     fingerprint, checksum, params_len, n_sections, _reserved) = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CodecError("not a tierkv block (bad magic)")
    if version != FORMAT_VERSION:
        raise CodecError(f"unsupported block format version {version}")
    if params_len > MAX_PARAMS_BYTES or n_sections > MAX_SECTIONS:
        raise CodecError("header declares too many parameters or sections")
    header_len = _FIXED.size + params_len + n_sections * _SECTION.size + _HASH.size
    if total < header_len:
        raise CodecError(f"truncated block header ({total} B < {header_len} B)")
    (stored_hash,) = _HASH.unpack_from(mv, header_len - _HASH.size)
    if xxhash.xxh3_64_intdigest(mv[:header_len - _HASH.size]) != stored_hash:
        raise CodecError("block header hash mismatch")
    codec = codec_by_id(codec_id)
    if codec is None:
        raise CodecError(f"unknown codec id {codec_id}")
    if dtype_id not in DTYPE_NAMES or scope not in _SCOPES:
        raise CodecError("unknown dtype or checksum scope")
    try:
        layout = Layout(n_layers, n_heads, head_dim, block_tokens, DTYPE_NAMES[dtype_id])
    except ValueError as exc:
        raise CodecError(f"bad layout in header: {exc}") from None
    if raw_len != layout.block_bytes:
        raise CodecError(f"raw length {raw_len} does not match the layout ({layout.block_bytes} B)")
    if scope != codec.checksum_scope:
        raise CodecError("checksum scope does not match the codec")
    off = _FIXED.size
    params = codec.check_params(layout, _unpack_params(bytes(mv[off:off + params_len])))
    off += params_len
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
    expected = codec.section_sizes(layout, params)
    if [s.decoded_len for s in sections] != expected:
        raise CodecError(f"section sizes {[s.decoded_len for s in sections]} do not match the layout {expected}")
    if sum(s.stored_len for s in sections) != total - header_len:
        raise CodecError(f"section lengths do not match the payload ({total - header_len} B)")
    return BlockHeader(version=version, codec=codec.name, codec_id=codec_id, params=params, dtype=layout.dtype,
                       layout=layout.to_dict(), fingerprint=bytes(fingerprint), raw_len=raw_len, stored_len=total,
                       header_len=header_len, checksum=bytes(checksum), checksum_scope=_SCOPES[scope],
                       sections=tuple(sections))

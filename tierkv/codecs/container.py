"""The block container: a self-describing header in front of the encoded sections.

Layout (little-endian)::

    fixed part   magic "TKVB", format version, codec id, dtype id, checksum scope,
                 num_layers, num_kv_heads, head_dim, block_tokens (u32 each), raw_len (u64),
                 namespace fingerprint (16 B), checksum (xxh3_128, 16 B), params_len (u16),
                 section count (u8), layout kind (u8: 0 K and V, 1 latent)
    params       msgpack map of the codec's parameters (params_len bytes, may be empty)
    sections     per section: method (u8: 0 raw, 1 zstd), stored_len (u32), decoded_len (u32)
    frame hash   xxh3_64 of the zstd sections' stored bytes, back to back (8 B; 0 bytes hashed if none)
    header hash  xxh3_64 of everything above (8 B)
    payload      the sections' stored bytes, back to back

The checksum covers the raw block (or, for lossy codecs, the decoded sections), then the namespace
fingerprint, then the block key; the key itself is not stored, so a value copied under another key
fails verification. A zstd frame has bits its decoder ignores (a reserved bit of the frame header,
unused bits of literal and table headers): a flip there decodes to the same bytes, which the checksum
cannot see, so the frame hash covers the frames as stored and is checked before decompressing. The
header hash lets a scan validate headers without decoding payloads.
Packing lives here; :mod:`tierkv.codecs.header` parses and validates against the codec registry.
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
# 2: blocks are keyed under namespaces that carry the model's identity (its weights, config and dtype),
# not its name; a block of format 1 belongs to a namespace no engine registers any more, and is dropped.
# 3: the frame hash. A value of format 2 (keyed alike, framed without it) is still read, its frames unhashed.
FORMAT_VERSION = 3
EARLIEST_READ = 2
FINGERPRINT_BYTES = 16
MAX_PARAMS_BYTES = 512
MAX_SECTIONS = 16

_FIXED = struct.Struct("<4sBBBBIIIIQ16s16sHBB")
_SECTION = struct.Struct("<BII")
_HASH = struct.Struct("<Q")
_FRAME_HASH = struct.Struct("<Q")

# Ids are part of the on-disk format: never renumber, only append.
DTYPE_IDS: dict[str, int] = {"float32": 1, "float16": 2, "bfloat16": 3, "float8_e4m3fn": 4, "float8_e5m2": 5,
                             "int8": 6, "uint8": 7}
DTYPE_NAMES = {v: k for k, v in DTYPE_IDS.items()}
SCOPE_RAW = 1  # checksum over the raw block bytes
SCOPE_SECTIONS = 2  # checksum over the decoded sections (lossy codecs: the original is not recoverable)
_SCOPES = {SCOPE_RAW: "raw", SCOPE_SECTIONS: "sections"}
_METHODS = {0: "raw", 1: "zstd"}
# Ids are part of the on-disk format (the header's last fixed byte): never renumber, only append.
KIND_IDS: dict[str, int] = {"kv": 0, "latent": 1}
KIND_NAMES = {v: k for k, v in KIND_IDS.items()}


_MIN_FRAME = 8  # magic, frame header descriptor, one block header


def _compress_bound(n: int) -> int:
    """ZSTD_COMPRESSBOUND: the largest frame zstd produces for ``n`` input bytes."""
    return n + (n >> 8) + (((128 << 10) - n) >> 11 if n < (128 << 10) else 0)


class CodecError(TierKVError):
    """A stored block is corrupt, truncated, foreign or hostile; treat it as a miss."""

    code = "corrupt"


class ForeignBlock(CodecError):
    """An intact block of another namespace (other weights, adapter, layout or format): a miss."""


class EarlierFormat(CodecError):
    """A block an earlier tierkv wrote (an older container format): a miss, dropped."""


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
        frame_hash: xxh3_64 of the zstd sections' stored bytes (``None``: a value of format 2, without it).
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
    frame_hash: int | None = None

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


def unpack_params(data: bytes) -> dict[str, Any]:
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


def frame_hash(frames: list[Any]) -> int:
    """xxh3_64 of the zstd sections' stored bytes, in order."""
    h = xxhash.xxh3_64()
    for f in frames:
        h.update(f)
    return h.intdigest()


def pack_header(*, codec_id: int, layout: Layout, fingerprint: bytes, checksum: bytes, scope: int,
                params: bytes, sections: list[tuple[int, int, int]], frames: int | None = None) -> bytes:
    """Build the header bytes (fixed part, params, section table, frame hash, header hash); ``frames`` is
    the frame hash (:func:`frame_hash`; ``None``: of no frames)."""
    head = bytearray(_FIXED.pack(MAGIC, FORMAT_VERSION, codec_id, DTYPE_IDS[layout.dtype], scope,
                                 layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_tokens,
                                 layout.block_bytes, fingerprint, checksum, len(params), len(sections),
                                 KIND_IDS[layout.kind]))
    head += params
    for method, stored, decoded in sections:
        head += _SECTION.pack(method, stored, decoded)
    head += _FRAME_HASH.pack(frame_hash([]) if frames is None else frames)
    head += _HASH.pack(xxhash.xxh3_64_intdigest(head))
    return bytes(head)

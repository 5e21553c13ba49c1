"""Cold-tier block codecs: a self-describing, checksummed container around lossless or quantizing codecs.

Public API::

    blob = encode_block(raw, layout=..., fingerprint=..., key=..., codec="lossless", level=1)
    out = decode_block(blob, layout=..., fingerprint=..., key=..., out=None)
    header = read_header(blob)
    available_codecs()  # ["raw", "zstd", "lossless", "fp8", "int8", "int4"]

Every block records its own codec, so a tier can switch codecs at run time: new writes use the new
codec and old blocks stay readable.
"""

from __future__ import annotations

from tierkv.codecs.container import BlockHeader, CodecError, EarlierFormat, ForeignBlock, Section
from tierkv.codecs.encoding import decode_block, encode_block
from tierkv.codecs.header import read_header
from tierkv.codecs.registry import available_codecs, get_codec

__all__ = ["BlockHeader", "CodecError", "EarlierFormat", "ForeignBlock", "Section", "available_codecs", "decode_block", "encode_block", "get_codec",
           "read_header"]

"""Codec registry: names and on-disk ids of every codec."""

from __future__ import annotations

from tierkv.codecs.base import Codec
from tierkv.codecs.lossless import LosslessCodec, RawCodec, ZstdCodec
from tierkv.codecs.quant import Fp8Codec, Int4Codec, Int8Codec

_BY_NAME: dict[str, Codec] = {}
_BY_ID: dict[int, Codec] = {}


def register(codec: Codec) -> None:
    """Add a codec (import time only: lookups are not locked)."""
    if codec.name in _BY_NAME or codec.codec_id in _BY_ID:
        raise ValueError(f"codec {codec.name!r} / id {codec.codec_id} already registered")
    _BY_NAME[codec.name] = codec
    _BY_ID[codec.codec_id] = codec


for _codec in (RawCodec(), ZstdCodec(), LosslessCodec(), Fp8Codec(), Int8Codec(), Int4Codec()):
    register(_codec)


def get_codec(name: str) -> Codec:
    """The codec called ``name``; ``ValueError`` if there is none."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown codec {name!r}; choose one of {available_codecs()}") from None


def codec_by_id(codec_id: int) -> Codec | None:
    """The codec with on-disk id ``codec_id``, or ``None``."""
    return _BY_ID.get(codec_id)


def available_codecs() -> list[str]:
    """Names of all codecs, lossless ones first."""
    return list(_BY_NAME)

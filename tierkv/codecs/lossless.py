"""Lossless codecs: ``raw``, plain ``zstd`` and the byte-plane ``lossless`` codec.

``lossless`` splits each element into its bytes and stores each byte position as one plane, most
significant first. The top plane holds the sign and most exponent bits, whose histogram is narrow (about
3 bits of entropy per byte on bf16 KV), so zstd shrinks it about 2.6x; mantissa planes are close to
random and are stored as they are unless a 4 KiB probe says they compress (constant or zero-padded data).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tierkv.codecs.base import Codec
from tierkv.codecs.zstdio import Policy
from tierkv.core.layout import Layout

_merge_planes: Callable[[np.ndarray, list[Any]], None] | None
try:  # one-pass plane merge from tierkv/_native/ntcopy.c; numpy's shift-or below is the fallback
    from tierkv._native._ntcopy import merge_planes as _merge_planes
except ImportError:  # pragma: no cover
    _merge_planes = None

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


class RawCodec(Codec):
    """The block's bytes as they are (reference, and the fallback when nothing compresses)."""

    name = "raw"
    codec_id = 0

    def section_sizes(self, layout: Layout, params: dict[str, Any]) -> list[int]:
        return [layout.block_bytes]

    def encode(self, raw: np.ndarray, layout: Layout, params: dict[str, Any]) -> list[tuple[Any, Policy]]:
        return [(raw, Policy.RAW)]

    def decode(self, sections: list[Any], layout: Layout, params: dict[str, Any], out: np.ndarray) -> None:
        out[:] = np.frombuffer(sections[0], dtype=np.uint8)


class ZstdCodec(RawCodec):
    """Plain zstd of the raw bytes at the requested level (the reference the byte-plane codec beats)."""

    name = "zstd"
    codec_id = 1

    def encode(self, raw: np.ndarray, layout: Layout, params: dict[str, Any]) -> list[tuple[Any, Policy]]:
        return [(raw, Policy.FORCE)]


class LosslessCodec(Codec):
    """Byte-plane split plus zstd on the planes that compress; bit-exact for every dtype.

    Option ``channel_major`` (default False) orders each plane [K/V, layer, head, channel, token] instead
    of the block's token-major order: about 1% smaller on real bf16 KV but slower to encode and decode
    (the transpose), so it is off by default.
    """

    name = "lossless"
    codec_id = 2

    def make_params(self, layout: Layout, options: dict[str, Any]) -> dict[str, Any]:
        options = dict(options)
        channel_major = options.pop("channel_major", False)
        if options:
            raise ValueError(f"unknown lossless options {sorted(options)}")
        if not isinstance(channel_major, bool):
            raise ValueError("channel_major must be a bool")
        return {"channel_major": channel_major} if channel_major else {}

    def section_sizes(self, layout: Layout, params: dict[str, Any]) -> list[int]:
        return [layout.block_elems] * layout.itemsize

    @staticmethod
    def _words(buf: np.ndarray, layout: Layout, channel_major: bool) -> np.ndarray:
        """The block as unsigned words of the element size; [K/V, layer, head, channel, token] if channel-major."""
        words = buf.view(_UINT[layout.itemsize])
        if channel_major:
            words = words.reshape(layout.block_shape).transpose(0, 1, 2, 4, 3)
        return words

    def encode(self, raw: np.ndarray, layout: Layout, params: dict[str, Any]) -> list[tuple[Any, Policy]]:
        n = layout.itemsize
        if n == 1:
            return [(raw, Policy.TRY)]
        words = self._words(raw, layout, bool(params.get("channel_major", False)))
        # Shift-and-narrow casts are SIMD in numpy, ~4x faster than strided byte gathers.
        planes = [(words >> (8 * j) if j else words).astype(np.uint8, order="C") for j in range(n - 1, -1, -1)]
        # The top plane carries the exponent: always worth compressing. The others are probed.
        return [(p, Policy.TRY if i == 0 else Policy.PROBE) for i, p in enumerate(planes)]

    def decode(self, sections: list[Any], layout: Layout, params: dict[str, Any], out: np.ndarray) -> None:
        channel_major = bool(params.get("channel_major", False))
        if _merge_planes is not None and not channel_major and out.flags.c_contiguous:
            _merge_planes(out, sections)  # one native pass (tierkv/_native/ntcopy.c), GIL released
            return
        words = self._words(out, layout, channel_major)
        planes = [np.frombuffer(sec, dtype=np.uint8).reshape(words.shape) for sec in sections]
        words[...] = planes[0]
        for plane in planes[1:]:  # most significant first: shift the word up, or the next byte in
            words <<= 8
            words |= plane

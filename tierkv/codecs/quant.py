"""Quantizing codecs (lossy, opt-in): ``fp8``, ``int8`` and ``int4``.

All three decode to the block's own dtype and shape. They take float16, bfloat16 and float32 blocks
with finite values (``int8`` and ``int4`` only K/V layouts: their key and value scales differ; ``fp8``
latent ones too); any other block is stored with ``lossless`` instead (the pipeline's fallback).
Their checksum covers the stored sections (codes and scales) plus namespace and key, since the original
bytes cannot be rebuilt.

Metadata is kept small because a 16-token block amortises per-channel scales over only 16 values:
each (K/V, layer, head) keeps one float32 range, and each channel or token group keeps 8-bit codes
relative to it:

* symmetric scales (int8): code ``e`` means ``head_absmax / 127 * 2**(-e/16)``, the largest such
  scale not below the group's own ``absmax / 127`` (at most 4.4% coarser than exact);
* asymmetric ranges (int4): codes ``lo_c, hi_c`` on a 255-step grid of the head's ``[min, max]``,
  rounded outwards so the group's values stay inside.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tierkv.codecs.base import Codec
from tierkv.codecs.container import SCOPE_SECTIONS
from tierkv.codecs.floats import FLOAT_DTYPES, from_float32, to_float32
from tierkv.codecs.zstdio import Policy
from tierkv.core.layout import Layout

_F32 = np.float32
# 2**(-e/16) for e = 0..255, computed in float64 then rounded: identical on every machine.
_LOG_LUT = np.array([2.0 ** (-e / 16) for e in range(256)], dtype=np.float32)
_LOG_LUT_ASC = np.ascontiguousarray(_LOG_LUT[::-1])
_E4M3_MAX = 448.0


def _e4m3_table() -> np.ndarray:
    """float32 value of every FP8 E4M3 (fn) code; 0x7F and 0xFF are NaN."""
    c = np.arange(256)
    exp, man = (c >> 3) & 15, c & 7
    mag = np.where(exp == 0, man * 2.0 ** -9, (1 + man / 8) * 2.0 ** (exp - 7))
    mag[(c & 0x7F) == 0x7F] = np.nan
    return np.where(c & 0x80, -mag, mag).astype(np.float32)


_E4M3_LUT = _e4m3_table()


def to_e4m3(y: np.ndarray) -> np.ndarray:
    """Round float32 values with |y| <= 448 to FP8 E4M3 codes (nearest, ties to even), in numpy."""
    bits = y.view(np.uint32)
    mag = bits & np.uint32(0x7FFFFFFF)
    # normal range: round the 23-bit mantissa to 3 bits, then rebias the exponent (127 -> 7)
    normal = (mag + np.uint32(0x7FFFF) + ((mag >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20)
    normal -= np.uint32(120 << 3)
    # below 2**-6 the codes are a fixed-point count of 2**-9 steps
    sub = np.rint(np.abs(y) * _F32(512)).astype(np.uint32)
    code = np.where(mag < np.uint32(0x3C800000), sub, normal)
    code |= (bits >> np.uint32(24)) & np.uint32(0x80)
    return code.astype(np.uint8)
_TINY = 1e-30  # scales below this are treated as zero: their values are below 1e-27


def _recip(a: np.ndarray, floor: float = 0.0) -> np.ndarray:
    """1/a where a > floor, else 0 (no warnings, no inf)."""
    out = np.zeros_like(a)
    np.divide(_F32(1), a, out=out, where=a > floor)
    return out


# --- symmetric 8-bit, log-coded scales --------------------------------------------------------------

def _log_codes(ratio: np.ndarray) -> np.ndarray:
    """Largest e in [0, 255] with 2**(-e/16) >= ratio (ratio in [0, 1])."""
    idx = np.searchsorted(_LOG_LUT_ASC, ratio, side="left")
    return (255 - np.minimum(idx, 255)).astype(np.uint8)


def _sym_scale(hmax: np.ndarray, code: np.ndarray) -> np.ndarray:
    return (hmax * _F32(1 / 127)) * _LOG_LUT[code]


def _sym8_encode(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [L, H, T, D] -> head absmax [L, H, 1, 1] f32, per-group codes (reduced over ``axis``), int8 codes."""
    a = np.abs(x)
    gmax = a.max(axis=axis, keepdims=True)
    hmax = gmax.max(axis=(2, 3), keepdims=True)
    code = _log_codes(gmax * _recip(hmax))
    q = np.rint(x * _recip(_sym_scale(hmax, code), _TINY))
    np.clip(q, -127, 127, out=q)
    return hmax, code, q.astype(np.int8)


def _sym8_decode(hmax: np.ndarray, code: np.ndarray, q: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * _sym_scale(hmax, code)


# --- asymmetric 4-bit, grid-coded ranges ------------------------------------------------------------

def _asym_grid(lo: np.ndarray, hi: np.ndarray, cmin: np.ndarray, cmax: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    unit = (hi - lo) * _F32(1 / 255)
    base = lo + cmin.astype(np.float32) * unit
    step = (cmax.astype(np.float32) - cmin.astype(np.float32)) * unit * _F32(1 / 15)
    return base, step


def _asym4_encode(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """x [L, H, ...] -> head ranges [L, H, ..., 2] f32, group codes [..., 2] uint8, 4-bit codes (uint8)."""
    head_axes = tuple(range(2, x.ndim))
    gmin = x.min(axis=axis, keepdims=True)
    gmax = x.max(axis=axis, keepdims=True)
    lo = gmin.min(axis=head_axes, keepdims=True)
    hi = gmax.max(axis=head_axes, keepdims=True)
    unit = (hi - lo) * _F32(1 / 255)
    if not np.isfinite(unit).all():  # a range wider than float32 (values near float32 max)
        return None
    inv_unit = _recip(unit, _TINY)
    cmin = np.clip(np.floor((gmin - lo) * inv_unit), 0, 255).astype(np.uint8)
    cmax = np.clip(np.ceil((gmax - lo) * inv_unit), 0, 255).astype(np.uint8)
    base, step = _asym_grid(lo, hi, cmin, cmax)
    q = np.rint((x - base) * _recip(step))
    np.clip(q, 0, 15, out=q)
    return np.stack([lo, hi], axis=-1), np.stack([cmin, cmax], axis=-1), q.astype(np.uint8)


def _asym4_decode(ranges: np.ndarray, codes: np.ndarray, q: np.ndarray) -> np.ndarray:
    base, step = _asym_grid(ranges[..., 0], ranges[..., 1], codes[..., 0], codes[..., 1])
    return base + q.astype(np.float32) * step


def _pack4(q: np.ndarray) -> np.ndarray:
    flat = q.reshape(-1)
    return flat[0::2] | (flat[1::2] << np.uint8(4))


def _unpack4(packed: np.ndarray, n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.uint8)
    np.bitwise_and(packed, 15, out=out[0::2])
    np.right_shift(packed, 4, out=out[1::2])
    return out


class _Reader:
    """Cuts typed arrays off the front of a buffer, in order."""

    def __init__(self, buf: Any) -> None:
        self.buf, self.off = buf, 0

    def take(self, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(shape))
        arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.off).reshape(shape)
        self.off += count * np.dtype(dtype).itemsize
        return arr


class _QuantCodec(Codec):
    """Common frame of the quantizing codecs: float32 in, two sections (metadata, codes) out."""

    checksum_scope = SCOPE_SECTIONS
    lossy = True

    kv_only = True  # quantizes K and V apart: a latent layout is stored with the fallback codec

    def encode(self, raw: np.ndarray, layout: Layout, params: dict[str, Any]) -> list[tuple[Any, Policy]] | None:
        if layout.dtype not in FLOAT_DTYPES or (self.kv_only and layout.kind != "kv"):
            return None
        x = to_float32(raw, layout)
        if not np.isfinite(x).all():
            return None
        with np.errstate(all="ignore"):
            parts = self._quantize(x, layout, params)
        if parts is None:
            return None
        meta, codes = parts
        return [(meta, Policy.PROBE), (codes, Policy.PROBE)]

    def decode(self, sections: list[Any], layout: Layout, params: dict[str, Any], out: np.ndarray) -> None:
        x = self._dequantize(sections[0], sections[1], layout, params)
        from_float32(x, layout, out)

    def _quantize(self, x: np.ndarray, layout: Layout, params: dict[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
        raise NotImplementedError

    def _dequantize(self, meta: Any, codes: Any, layout: Layout, params: dict[str, Any]) -> np.ndarray:
        raise NotImplementedError


class Fp8Codec(_QuantCodec):
    """FP8 E4M3 codes with one float32 scale per (K/V or latent, layer, head): 2x smaller than 16-bit, ~2.5%
    error."""

    name = "fp8"
    max_rel_rmse = 0.03
    codec_id = 3
    kv_only = False

    def section_sizes(self, layout: Layout, params: dict[str, Any]) -> list[int]:
        return [layout.planes * layout.num_layers * layout.num_kv_heads * 4, layout.block_elems]

    def _quantize(self, x: np.ndarray, layout: Layout, params: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        scale = (np.abs(x).max(axis=(3, 4), keepdims=True) * _F32(1 / _E4M3_MAX)).astype(np.float32)
        y = x * _recip(scale, _TINY)
        np.clip(y, -_E4M3_MAX, _E4M3_MAX, out=y)
        return scale.reshape(-1), to_e4m3(y).reshape(-1)

    def _dequantize(self, meta: Any, codes: Any, layout: Layout, params: dict[str, Any]) -> np.ndarray:
        L, H = layout.num_layers, layout.num_kv_heads
        scale = np.frombuffer(meta, dtype=np.float32).reshape(layout.planes, L, H, 1, 1)
        q = np.frombuffer(codes, dtype=np.uint8).reshape(layout.block_shape)
        return _E4M3_LUT[q] * scale


def _int8_meta_bytes(n_layers: int, layout: Layout) -> int:
    H, T, D = layout.num_kv_heads, layout.block_tokens, layout.head_dim
    return n_layers * H * (8 + D + T)


def _int4_meta_bytes(n_layers: int, layout: Layout, group: int) -> int:
    H, T, D = layout.num_kv_heads, layout.block_tokens, layout.head_dim
    return n_layers * H * (16 + 2 * D + 2 * T * (D // group))


def _int8_layers_encode(k: np.ndarray, v: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """K per channel (over tokens), V per token (over channels)."""
    hk, ck, qk = _sym8_encode(k, axis=2)
    hv, cv, qv = _sym8_encode(v, axis=3)
    return [hk.reshape(-1), hv.reshape(-1), ck.reshape(-1), cv.reshape(-1)], np.concatenate(
        [qk.reshape(-1), qv.reshape(-1)]).view(np.uint8)


def _int8_layers_decode(meta: _Reader, codes: _Reader, n: int, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    H, T, D = layout.num_kv_heads, layout.block_tokens, layout.head_dim
    hk = meta.take(np.float32, (n, H, 1, 1))
    hv = meta.take(np.float32, (n, H, 1, 1))
    ck = meta.take(np.uint8, (n, H, 1, D))
    cv = meta.take(np.uint8, (n, H, T, 1))
    k = _sym8_decode(hk, ck, codes.take(np.int8, (n, H, T, D)))
    v = _sym8_decode(hv, cv, codes.take(np.int8, (n, H, T, D)))
    return k, v


class Int8Codec(_QuantCodec):
    """Symmetric int8: keys scaled per channel, values per token. ~1.9x on 16-bit blocks, <1% error."""

    name = "int8"
    max_rel_rmse = 0.01
    codec_id = 4

    def section_sizes(self, layout: Layout, params: dict[str, Any]) -> list[int]:
        return [_int8_meta_bytes(layout.num_layers, layout), layout.block_elems]

    def _quantize(self, x: np.ndarray, layout: Layout, params: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        meta, codes = _int8_layers_encode(x[0], x[1])
        return np.concatenate([m.view(np.uint8) for m in meta]), codes

    def _dequantize(self, meta: Any, codes: Any, layout: Layout, params: dict[str, Any]) -> np.ndarray:
        k, v = _int8_layers_decode(_Reader(meta), _Reader(codes), layout.num_layers, layout)
        return np.stack([k, v])


class Int4Codec(_QuantCodec):
    """KIVI-style asymmetric int4: keys per channel, values per token in groups along the head dim;
    the first ``int8_layers`` layers (shallow layers are the most sensitive) are kept at int8.

    Options: ``int8_layers`` (default 2), ``group`` (value group size, default 32, must divide head_dim;
    the whole head_dim when 32 does not divide it).
    """

    name = "int4"
    max_rel_rmse = 0.09
    codec_id = 5

    def make_params(self, layout: Layout, options: dict[str, Any]) -> dict[str, Any]:
        options = dict(options)
        int8_layers = options.pop("int8_layers", 2)
        group = options.pop("group", 32 if layout.head_dim % 32 == 0 else layout.head_dim)
        if options:
            raise ValueError(f"unknown int4 options {sorted(options)}")
        for name, value in (("int8_layers", int8_layers), ("group", group)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"int4 {name} must be a non-negative int, got {value!r}")
        if group == 0 or layout.head_dim % group:
            raise ValueError(f"int4 group {group} must divide head_dim {layout.head_dim}")
        return {"int8_layers": min(int8_layers, layout.num_layers), "group": group}

    def section_sizes(self, layout: Layout, params: dict[str, Any]) -> list[int]:
        n8 = params["int8_layers"]
        n4 = layout.num_layers - n8
        per_layer = layout.num_kv_heads * layout.block_tokens * layout.head_dim
        return [_int8_meta_bytes(n8, layout) + _int4_meta_bytes(n4, layout, params["group"]),
                2 * n8 * per_layer + n4 * per_layer]

    def _quantize(self, x: np.ndarray, layout: Layout, params: dict[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
        n8, g = params["int8_layers"], params["group"]
        n4 = layout.num_layers - n8
        H, T, D = layout.num_kv_heads, layout.block_tokens, layout.head_dim
        meta: list[np.ndarray] = []
        codes: list[np.ndarray] = []
        if n8:
            meta8, codes8 = _int8_layers_encode(x[0, :n8], x[1, :n8])
            meta += [m.view(np.uint8) for m in meta8]
            codes.append(codes8)
        if n4:
            k4 = _asym4_encode(x[0, n8:], axis=2)
            v4 = _asym4_encode(x[1, n8:].reshape(n4, H, T, D // g, g), axis=4)
            if k4 is None or v4 is None:
                return None
            meta += [k4[0].reshape(-1).view(np.uint8), v4[0].reshape(-1).view(np.uint8), k4[1].reshape(-1),
                     v4[1].reshape(-1)]
            codes.append(_pack4(np.concatenate([k4[2].reshape(-1), v4[2].reshape(-1)])))
        return np.concatenate(meta), np.concatenate(codes)

    def _dequantize(self, meta: Any, codes: Any, layout: Layout, params: dict[str, Any]) -> np.ndarray:
        n8, g = params["int8_layers"], params["group"]
        n4 = layout.num_layers - n8
        H, T, D = layout.num_kv_heads, layout.block_tokens, layout.head_dim
        m, c = _Reader(meta), _Reader(codes)
        out = np.empty((2, layout.num_layers, H, T, D), dtype=np.float32)
        if n8:
            out[0, :n8], out[1, :n8] = _int8_layers_decode(m, c, n8, layout)
        if not n4:
            return out
        rk = m.take(np.float32, (n4, H, 1, 1, 2))
        rv = m.take(np.float32, (n4, H, 1, 1, 1, 2))
        ck = m.take(np.uint8, (n4, H, 1, D, 2))
        cv = m.take(np.uint8, (n4, H, T, D // g, 1, 2))
        q = _unpack4(c.take(np.uint8, (n4 * H * T * D,)), 2 * n4 * H * T * D)
        half = n4 * H * T * D
        out[0, n8:] = _asym4_decode(rk, ck, q[:half].reshape(n4, H, T, D))
        out[1, n8:] = _asym4_decode(rv, cv, q[half:].reshape(n4, H, T, D // g, g)).reshape(n4, H, T, D)
        return out

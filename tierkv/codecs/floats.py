"""float32 views of float blocks and back, in numpy (bfloat16 has no numpy type: handled as uint16 bits)."""

from __future__ import annotations

import numpy as np

from tierkv.core.layout import Layout

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38}


def to_float32(raw: np.ndarray, layout: Layout) -> np.ndarray:
    """The block as float32 ``[2, L, H, T, D]`` (a copy for 16-bit types, a view for float32)."""
    if layout.dtype == "bfloat16":
        x = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif layout.dtype == "float16":
        x = raw.view(np.float16).astype(np.float32)
    elif layout.dtype == "float32":
        x = raw.view(np.float32)
    else:
        raise ValueError(f"not a float dtype: {layout.dtype}")
    return x.reshape(layout.block_shape)


def from_float32(x: np.ndarray, layout: Layout, out: np.ndarray) -> None:
    """Round ``x`` (finite float32, any shape of ``layout.block_elems``) to ``layout.dtype`` into ``out`` (uint8).

    Values beyond the dtype's range saturate (a reconstruction can overshoot the original by half a step).
    """
    x = np.clip(x.reshape(-1), -_MAX[layout.dtype], _MAX[layout.dtype])
    if layout.dtype == "bfloat16":
        bits = x.view(np.uint32)
        bits += np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))  # round to nearest even
        out.view(np.uint16)[:] = bits >> np.uint32(16)
    elif layout.dtype == "float16":
        out.view(np.float16)[:] = x
    else:
        out.view(np.float32)[:] = x

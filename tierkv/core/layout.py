"""Layout: the KV geometry of one model, which fixes the bytes and shape of a block."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

# Canonical dtype names (torch's own); numpy has no bfloat16 / float8, so those bytes are handled as
# uint8/uint16 there. torch is imported only where a torch dtype is asked for: the daemon never needs
# it, and importing it costs seconds.
_NAMES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8")
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1}
_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
            "fp8": "float8_e4m3fn", "float8": "float8_e4m3fn"}
# numpy dtypes that carry the same bytes (bfloat16 and fp8 have no numpy type: viewed as raw ints).
_NUMPY_VIEW = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "float8_e4m3fn": np.uint8,
               "float8_e5m2": np.uint8, "int8": np.int8, "uint8": np.uint8}


def dtype_name(dtype: Any) -> str:
    """Return the canonical name of a torch dtype, numpy dtype or string (``"bfloat16"``, ...)."""
    torch_mod = sys.modules.get("torch")
    if torch_mod is not None and isinstance(dtype, torch_mod.dtype):
        name = str(dtype).removeprefix("torch.")
        if name in _NAMES:
            return name
        raise ValueError(f"unsupported dtype {dtype}")
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype.lower(), dtype.lower()).removeprefix("torch.")
        if name in _NAMES:
            return name
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(_NAMES)}")
    try:
        return dtype_name(np.dtype(dtype).name)
    except TypeError as exc:
        raise ValueError(f"unsupported dtype {dtype!r}") from exc


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a canonical dtype name."""
    import torch

    return getattr(torch, dtype_name(name))


def numpy_view_dtype(name: str) -> np.dtype:
    """A numpy dtype with the same item size (raw integers for bfloat16 and fp8)."""
    return np.dtype(_NUMPY_VIEW[dtype_name(name)])


@dataclass(frozen=True, slots=True)
class Layout:
    """KV geometry of one model.

    A block holds K and V for ``block_tokens`` tokens of every layer, shaped
    ``[2, num_layers, num_kv_heads, block_tokens, head_dim]``.

    Args:
        num_layers: transformer layers.
        num_kv_heads: key/value heads (per tensor-parallel rank).
        head_dim: channels per head.
        block_tokens: tokens per block (16 is the common page size).
        dtype: element type, as a torch dtype or name (``"bfloat16"``, ``"float16"``, ``"float32"``, ...).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: Any = "bfloat16"

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Layout.{field} must be a positive int, got {value!r}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.block_bytes > (1 << 31):
            raise ValueError(f"a block of {self.block_bytes} bytes is too large (max 2 GiB)")

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZE[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: ``(2, layers, kv_heads, block_tokens, head_dim)``."""
        return (2, self.num_layers, self.num_kv_heads, self.block_tokens, self.head_dim)

    @property
    def block_elems(self) -> int:
        """Elements in one block."""
        return 2 * self.num_layers * self.num_kv_heads * self.block_tokens * self.head_dim

    @property
    def block_bytes(self) -> int:
        """Bytes in one block."""
        return self.block_elems * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per token."""
        return self.block_bytes // self.block_tokens

    @property
    def torch_dtype(self) -> torch.dtype:
        """The element type as a torch dtype."""
        return torch_dtype(self.dtype)

    def batch_shape(self, n: int) -> tuple[int, ...]:
        """Shape of ``n`` blocks: ``(n, 2, layers, kv_heads, block_tokens, head_dim)``."""
        return (n, *self.block_shape)

    def to_dict(self) -> dict[str, Any]:
        """Plain fields, as sent on the wire and stored in headers."""
        return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "block_tokens": self.block_tokens, "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        """Inverse of :meth:`to_dict`; raises ``ValueError`` on missing or bad fields."""
        try:
            return cls(int(d["num_layers"]), int(d["num_kv_heads"]), int(d["head_dim"]), int(d["block_tokens"]),
                       str(d["dtype"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"bad layout {d!r}: {exc}") from exc

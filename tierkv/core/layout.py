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


KINDS = ("kv", "latent")


@dataclass(frozen=True, slots=True)
class Layout:
    """KV geometry of one model.

    A block holds K and V for ``block_tokens`` tokens of every layer, shaped
    ``[2, num_layers, num_kv_heads, block_tokens, head_dim]``. A ``latent`` layout (multi-head latent
    attention, as DeepSeek-V2/V3 cache it) holds one vector per token and layer and no V:
    ``[1, num_layers, 1, block_tokens, head_dim]``, ``head_dim`` the latent width (e.g. 512 + 64 rope).

    Args:
        num_layers: transformer layers.
        num_kv_heads: key/value heads (per tensor-parallel rank); 1 for a latent layout.
        head_dim: channels per head (the latent width for a latent layout).
        block_tokens: tokens per block (16 is the common page size).
        dtype: element type, as a torch dtype or name (``"bfloat16"``, ``"float16"``, ``"float32"``, ...).
        kind: ``"kv"`` (K and V per head) or ``"latent"`` (one vector per token, no V).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: Any = "bfloat16"
    kind: str = "kv"

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Layout.{field} must be a positive int, got {value!r}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.kind not in KINDS:
            raise ValueError(f"Layout.kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "latent" and self.num_kv_heads != 1:
            raise ValueError(f"a latent layout has one head, got {self.num_kv_heads}")
        if self.block_bytes > (1 << 31):
            raise ValueError(f"a block of {self.block_bytes} bytes is too large (max 2 GiB)")

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZE[self.dtype]

    @property
    def planes(self) -> int:
        """Tensors per layer: 2 (K and V) or 1 (a latent)."""
        return 1 if self.kind == "latent" else 2

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: ``(planes, layers, kv_heads, block_tokens, head_dim)``."""
        return (self.planes, self.num_layers, self.num_kv_heads, self.block_tokens, self.head_dim)

    @property
    def block_elems(self) -> int:
        """Elements in one block."""
        return self.planes * self.num_layers * self.num_kv_heads * self.block_tokens * self.head_dim

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
        """Shape of ``n`` blocks: ``(n, planes, layers, kv_heads, block_tokens, head_dim)``."""
        return (n, *self.block_shape)

    def to_dict(self) -> dict[str, Any]:
        """Plain fields, as sent on the wire and stored in headers (``kind`` only when not ``"kv"``)."""
        d = {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
             "block_tokens": self.block_tokens, "dtype": self.dtype}
        if self.kind != "kv":
            d["kind"] = self.kind
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        """Inverse of :meth:`to_dict`; raises ``ValueError`` on missing or bad fields."""
        try:
            return cls(int(d["num_layers"]), int(d["num_kv_heads"]), int(d["head_dim"]), int(d["block_tokens"]),
                       str(d["dtype"]), str(d.get("kind", "kv")))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"bad layout {d!r}: {exc}") from exc

"""Checks of what a caller passes to the client: keys, block tensors, output tensors, options.

Each raises :class:`~tierkv.core.errors.BadRequest` naming the problem before anything is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tierkv.core.errors import BadRequest
from tierkv.core.layout import Layout, numpy_view_dtype


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    """``keys`` as a list of distinct 1..128-byte keys."""
    if isinstance(keys, bytes | str):
        raise BadRequest("keys must be a sequence of bytes keys, not a single key")
    out = list(keys)
    for k in out:
        if not isinstance(k, bytes) or not (1 <= len(k) <= 128):
            raise BadRequest("each key must be 1..128 bytes")
    if len(set(out)) != len(out):
        raise BadRequest("keys contain duplicates")
    return out


def check_flag(value: object, name: str) -> bool:
    """A boolean option (``remote``) as a bool; anything else is a BadRequest (as the daemon says too)."""
    if type(value) is not bool:
        raise BadRequest(f"{name} must be a bool, got {value!r}")
    return value


def check_seconds(timeout: object) -> float:
    """A wait bound as float seconds within 0..3600 (ValueError otherwise)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= 3600:
        raise ValueError(f"timeout must be seconds within 0..3600, got {timeout!r}")
    return float(timeout)


def check_parent(parent: bytes | None, keys: list[bytes]) -> bytes | None:
    """``parent`` (the key a chain of ``keys`` continues) as a 1..128-byte key not among ``keys``, or None."""
    if parent is None:
        return None
    if not isinstance(parent, bytes) or not (1 <= len(parent) <= 128):
        raise BadRequest("parent must be a 1..128-byte key or None")
    if parent in keys:
        raise BadRequest("parent must not be one of the keys it precedes")
    return parent


def check_chains(chains: Sequence[tuple[int, bytes | None]] | None, keys: list[bytes]) -> list[list]:
    """``chains`` (where chains of ``keys`` start, and what each continues) for the wire: pairs of an
    increasing index into ``keys`` and a parent key or None; [] for the default (one chain, no parent)."""
    if chains is None:
        return []
    out, last = [], -1
    for pair in chains:
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise BadRequest("chains must be (index, parent) pairs")
        i, parent = pair
        if type(i) is not int or not last < i < len(keys):
            raise BadRequest(f"chain starts must be increasing indexes into the {len(keys)} keys, got {i!r}")
        out.append([i, check_parent(parent, keys)])
        last = i
    return [] if out == [[0, None]] else out


def check_blocks(layout: Layout, blocks: torch.Tensor | np.ndarray, n: int, device: str = "cpu") -> torch.Tensor:
    """``blocks`` as a contiguous tensor of ``n`` blocks of ``layout`` on ``device``."""
    shape = layout.batch_shape(n)
    if isinstance(blocks, np.ndarray):
        want = numpy_view_dtype(layout.dtype)
        if blocks.dtype != want:
            raise BadRequest(f"blocks dtype {blocks.dtype} does not match the layout ({layout.dtype}"
                             f"{', as raw uint16 in numpy' if layout.dtype == 'bfloat16' else ''})")
        t = torch.from_numpy(np.ascontiguousarray(blocks))
        if layout.dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
            t = t.view(layout.torch_dtype)
    elif isinstance(blocks, torch.Tensor):
        t = blocks
        if t.dtype != layout.torch_dtype:
            raise BadRequest(f"blocks dtype {t.dtype} does not match the layout ({layout.dtype})")
    else:
        raise BadRequest("blocks must be a torch tensor or numpy array")
    if tuple(t.shape) != shape:
        raise BadRequest(f"blocks have shape {tuple(t.shape)}; expected {shape} "
                         "[n, 2, layers, kv_heads, block_tokens, head_dim]")
    if t.device != torch.device(device):
        t = t.to(device)
    return t.contiguous()


def check_out(layout: Layout, out: torch.Tensor, n: int, device: str | None = None) -> None:
    """Raise unless ``out`` can take ``n`` blocks of ``layout`` (on ``device`` when given)."""
    shape = layout.batch_shape(n)
    if (tuple(out.shape) != shape or out.dtype != layout.torch_dtype or not out.is_contiguous()
            or (device is not None and out.device != torch.device(device))):
        where = "" if device is None else f" on {torch.device(device)}"
        raise BadRequest(f"out must be a contiguous {layout.dtype} tensor of shape {shape}{where}")


def first_tensor(caches: Any) -> Any:
    """The first tensor of a per-layer list (or the tensor itself): it tells where the caches live."""
    if isinstance(caches, list | tuple) and caches:
        return caches[0]
    return caches


def check_tokens(tokens: Sequence[int] | np.ndarray | None, n: int, block_tokens: int) -> bytes | None:
    """The token ids of ``n`` blocks (``n * block_tokens`` of them, in order) as int32 little-endian
    bytes for the wire; None stays None."""
    if tokens is None:
        return None
    arr = np.asarray(tokens)
    if arr.ndim != 1 or arr.size != n * block_tokens or (arr.size and arr.dtype.kind not in "iu"):
        raise BadRequest(f"tokens must be {n * block_tokens} integer token ids ({n} blocks of {block_tokens})")
    if arr.size and (arr.min() < 0 or arr.max() >= 1 << 31):
        raise BadRequest("token ids must be within 0..2^31-1")
    return arr.astype("<i4").tobytes()

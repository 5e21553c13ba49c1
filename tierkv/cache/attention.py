"""Per-block attention signals for the eviction policy: measured mass, or a Quest-style estimate.

Two paths feed ``client.touch(keys, scores)``:

- :func:`block_mass`: from attention probabilities the engine already computed
  (``[layers][heads, q, k]``), the mass each block of ``block_tokens`` keys received: max over
  heads (importance is head-specific), mean over layers, divided by what uniform attention would
  give the block, so 1.0 means "as much as uniform".
- Quest (Tang et al., ICML'24) for fused kernels that never expose attention: per block and KV head
  the element-wise min and max of its keys (:class:`KeyBounds`, recorded at commit). For a query
  ``q``, ``sum_i max(q_i * min_i, q_i * max_i)`` bounds ``q . k`` for every key of the block from
  above; :func:`quest_bound` ranks blocks with it and :func:`quest_mass` turns it into a mass
  estimate on the same scale as :func:`block_mass`.

Arrays may be numpy arrays or torch tensors (converted with ``numpy()``); results are numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def _np(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float32)


def _layers(attn: Any) -> list[np.ndarray]:
    """Normalise ``attn`` to a list of ``[heads, q, k]`` float32 arrays."""
    if isinstance(attn, (list, tuple)):
        layers = [_np(a) for a in attn]
    else:
        arr = _np(attn)
        if arr.ndim == 3:
            arr = arr[None]
        if arr.ndim != 4:
            raise ValueError(f"attention must be [layers][heads, q, k]; got an array of shape {arr.shape}")
        layers = list(arr)
    if not layers:
        raise ValueError("attention has no layers")
    out = []
    for i, a in enumerate(layers):
        if a.ndim == 4:  # [batch, heads, q, k] as transformers returns it
            if a.shape[0] != 1:
                raise ValueError(f"layer {i}: batch of {a.shape[0]}; pass one sequence at a time")
            a = a[0]
        if a.ndim != 3:
            raise ValueError(f"layer {i}: expected [heads, q, k], got shape {a.shape}")
        if out and a.shape != out[0].shape:
            raise ValueError(f"layer {i}: shape {a.shape} differs from layer 0's {out[0].shape}")
        out.append(a)
    return out


def uniform_key_mass(n_keys: int, n_queries: int, causal: bool = True) -> np.ndarray:
    """Mass each key gets from ``n_queries`` queries that attend uniformly.

    The queries are the last ``n_queries`` positions of ``n_keys`` (prefill has ``q == k``, a
    decode step ``q == 1``); with ``causal`` query ``i`` sees keys up to its own position.
    """
    if n_queries < 1 or n_keys < n_queries and causal:
        raise ValueError(f"need 1 <= n_queries <= n_keys, got q={n_queries}, k={n_keys}")
    if not causal:
        return np.full(n_keys, n_queries / n_keys, dtype=np.float64)
    pos = np.arange(n_keys - n_queries, n_keys, dtype=np.float64)
    suffix = np.cumsum((1.0 / (pos + 1.0))[::-1])[::-1]  # suffix[j] = sum over queries at pos >= j
    ref = np.empty(n_keys, dtype=np.float64)
    start = n_keys - n_queries
    ref[:start] = suffix[0]
    ref[start:] = suffix
    return ref


def _blocks(x: np.ndarray, block_tokens: int) -> np.ndarray:
    """Sum the last axis over blocks of ``block_tokens`` (the last block may be partial)."""
    n = x.shape[-1]
    nb = -(-n // block_tokens)
    pad = nb * block_tokens - n
    if pad:
        x = np.concatenate([x, np.zeros((*x.shape[:-1], pad), dtype=x.dtype)], axis=-1)
    return x.reshape(*x.shape[:-1], nb, block_tokens).sum(axis=-1)


def _reduce_heads(per_head: np.ndarray, num_kv_heads: int | None, per_kv_head: bool) -> np.ndarray:
    """``per_head`` is ``[layers, heads, blocks]`` -> ``[blocks]`` or ``[kv_heads, blocks]``."""
    heads = per_head.shape[1]
    if num_kv_heads is not None:
        if num_kv_heads < 1 or heads % num_kv_heads:
            raise ValueError(f"{heads} query heads cannot share {num_kv_heads} KV heads evenly")
        group = heads // num_kv_heads  # query head h reads KV head h // group (repeat_kv order)
        per_kv = per_head.reshape(per_head.shape[0], num_kv_heads, group, -1).max(axis=2)
        if per_kv_head:
            return per_kv.mean(axis=0)
        return per_kv.max(axis=1).mean(axis=0)
    if per_kv_head:
        raise ValueError("per_kv_head needs num_kv_heads")
    return per_head.max(axis=1).mean(axis=0)


def block_mass_from_key_mass(key_mass: Any, block_tokens: int, n_queries: int,
                             num_kv_heads: int | None = None, *, per_kv_head: bool = False,
                             causal: bool = True) -> np.ndarray:
    """:func:`block_mass` from attention already summed over queries.

    Args:
        key_mass: ``[layers, heads, k]``: per key, the attention probability summed over the
            ``n_queries`` queries (e.g. ``attn_mass_kvseq_per_head.npy`` of the kv-sample).
        block_tokens: keys per block.
        n_queries: queries that were summed (the last ``n_queries`` positions).
        num_kv_heads: KV heads when the model uses grouped-query attention.
        per_kv_head: return ``[kv_heads, blocks]`` (max over the query heads of each group).
        causal: queries only see keys up to their own position.

    Returns:
        Per block, mass relative to uniform attention (1.0 = uniform).
    """
    m = _np(key_mass).astype(np.float64)
    if m.ndim != 3:
        raise ValueError(f"key_mass must be [layers, heads, k], got shape {m.shape}")
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    ref = _blocks(uniform_key_mass(m.shape[-1], n_queries, causal), block_tokens)
    per_head = _blocks(m, block_tokens) / ref
    return _reduce_heads(per_head, num_kv_heads, per_kv_head)


def block_mass(attn: Any, block_tokens: int, num_kv_heads: int | None = None, *,
               per_kv_head: bool = False, causal: bool = True) -> np.ndarray:
    """Per-block attention mass from attention probabilities.

    Args:
        attn: ``[layers][heads, q, k]``: a list of per-layer arrays (``[1, heads, q, k]`` as in
            transformers' ``outputs.attentions`` is accepted) or one ``[layers, heads, q, k]`` array.
            The queries are the last ``q`` positions of the ``k`` keys.
        block_tokens: keys per block; the last block may be partial.
        num_kv_heads: KV heads under grouped-query attention (query head ``h`` reads KV head
            ``h // (heads // num_kv_heads)``); only needed for ``per_kv_head``, checked if given.
        per_kv_head: return ``[kv_heads, blocks]`` instead of ``[blocks]``.
        causal: queries only see keys up to their own position (sets the uniform reference).

    Returns:
        ``[blocks]`` float64: max over heads, mean over layers, divided by the mass uniform attention
        would put on the block; 1.0 means uniform.
    """
    layers = _layers(attn)
    heads, q, k = layers[0].shape
    key_mass = np.stack([a.sum(axis=1) for a in layers])  # [layers, heads, k]
    return block_mass_from_key_mass(key_mass, block_tokens, q, num_kv_heads,
                                    per_kv_head=per_kv_head, causal=causal)


# -- Quest -------------------------------------------------------------------------------------

@dataclass
class KeyBounds:
    """Element-wise key minimum and maximum per block and KV head.

    Attributes:
        kmin: ``[layers, kv_heads, blocks, head_dim]`` float32.
        kmax: same shape.
    """

    kmin: np.ndarray
    kmax: np.ndarray

    @classmethod
    def from_keys(cls, keys: Any, block_tokens: int) -> KeyBounds:
        """Bounds of ``keys`` ``[layers, kv_heads, tokens, head_dim]`` (post-RoPE, as cached)."""
        k = _np(keys)
        if k.ndim == 3:
            k = k[None]
        if k.ndim != 4:
            raise ValueError(f"keys must be [layers, kv_heads, tokens, head_dim], got shape {k.shape}")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        L, H, T, D = k.shape
        nb = -(-T // block_tokens)
        pad = nb * block_tokens - T
        lo = np.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0)), constant_values=np.inf) if pad else k
        hi = np.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0)), constant_values=-np.inf) if pad else k
        kmin = lo.reshape(L, H, nb, block_tokens, D).min(axis=3)
        kmax = hi.reshape(L, H, nb, block_tokens, D).max(axis=3)
        return cls(kmin.astype(np.float32), kmax.astype(np.float32))

    @classmethod
    def of_block(cls, block_keys: Any) -> KeyBounds:
        """Bounds of one block's keys ``[layers, kv_heads, tokens, head_dim]`` (recorded at commit)."""
        k = _np(block_keys)
        return cls.from_keys(k, k.shape[-2])

    @classmethod
    def concat(cls, parts: Sequence[KeyBounds]) -> KeyBounds:
        """Join per-block bounds along the block axis, in sequence order."""
        if not parts:
            raise ValueError("no bounds to join")
        return cls(np.concatenate([p.kmin for p in parts], axis=2), np.concatenate([p.kmax for p in parts], axis=2))

    @property
    def num_blocks(self) -> int:
        return self.kmin.shape[2]


def quest_bound(query: Any, bounds: KeyBounds) -> np.ndarray:
    """Upper bound of ``q . k`` over each block's keys, per layer and query head.

    Args:
        query: ``[layers, q_heads, head_dim]`` (or ``[q_heads, head_dim]`` for one layer), post-RoPE.
        bounds: key bounds with ``kv_heads`` dividing ``q_heads`` (grouped-query attention).

    Returns:
        ``[layers, q_heads, blocks]``: ``sum_i max(q_i * min_i, q_i * max_i)``.
    """
    q = _np(query)
    if q.ndim == 2:
        q = q[None]
    L, Hq, D = q.shape
    Lb, Hk, _, Db = bounds.kmin.shape
    if (L, D) != (Lb, Db) or Hq % Hk:
        raise ValueError(f"query {q.shape} does not match key bounds {bounds.kmin.shape}")
    group = Hq // Hk
    kmin = np.repeat(bounds.kmin, group, axis=1)  # [L, Hq, blocks, D]
    kmax = np.repeat(bounds.kmax, group, axis=1)
    qq = q[:, :, None, :]
    return np.maximum(qq * kmin, qq * kmax).sum(axis=-1)


def quest_mass(query: Any, bounds: KeyBounds, block_tokens: int | Sequence[int] | None = None,
               num_kv_heads: int | None = None, *, per_kv_head: bool = False) -> np.ndarray:
    """Estimate :func:`block_mass` for one decode step from the Quest bound.

    Per layer and head, a softmax over blocks of ``bound / sqrt(head_dim) + log(tokens in block)``
    stands in for the attention a block would receive (an optimistic one: every key of the block
    is assumed to score the bound), scaled so that uniform attention gives 1.0.

    Args:
        query: as in :func:`quest_bound`.
        bounds: key bounds of the blocks the query attends to.
        block_tokens: tokens per block (an int for equal blocks, a sequence per block, or
            ``None`` to treat blocks as equal).
        num_kv_heads, per_kv_head: as in :func:`block_mass`.

    Returns:
        ``[blocks]`` (or ``[kv_heads, blocks]``) float64, 1.0 = uniform.
    """
    b = quest_bound(query, bounds).astype(np.float64)
    nb = b.shape[-1]
    logits = b / np.sqrt(bounds.kmin.shape[-1])
    if block_tokens is None:
        tokens = np.ones(nb)
    elif isinstance(block_tokens, int):
        tokens = np.full(nb, float(block_tokens))
    else:
        tokens = np.asarray(block_tokens, dtype=np.float64)
        if tokens.shape != (nb,):
            raise ValueError(f"block_tokens has {tokens.shape} entries for {nb} blocks")
    logits = logits + np.log(np.maximum(tokens, 1e-9))
    logits -= logits.max(axis=-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=-1, keepdims=True)
    per_head = p / (tokens / tokens.sum())  # relative to uniform attention over the same tokens
    return _reduce_heads(per_head, num_kv_heads, per_kv_head)

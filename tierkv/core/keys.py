"""Namespace fingerprints and chained block keys.

A namespace is model id + layout (its kind included) + tensor-parallel rank + format version; its 16-byte fingerprint is
part of every stored key and is written into every encoded block, so a block is never served to a
model it does not belong to. Block keys chain over the prefix: ``key_i = H(ns, key_(i-1), tokens_i)``,
so equal keys mean equal prefixes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tierkv.core.layout import Layout

FORMAT_VERSION = 1
KEY_BYTES = 16
FINGERPRINT_BYTES = 16
MAX_KEY_BYTES = 128  # engines may bring opaque keys up to this size (LMDB allows 511 with the prefix)


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that makes KV of one model incompatible with another's."""

    model: str
    layout: Layout
    tp_rank: int = 0
    tp_size: int = 1
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model or len(self.model) > 256:
            raise ValueError("model must be a non-empty string of at most 256 characters")
        if not (0 <= self.tp_rank < self.tp_size):
            raise ValueError(f"tp_rank {self.tp_rank} out of range for tp_size {self.tp_size}")

    @property
    def fingerprint(self) -> bytes:
        """16-byte digest of every field; stored with each block."""
        lo = self.layout
        text = (f"tierkv/ns/v{self.format_version}|{self.model}|L{lo.num_layers}|H{lo.num_kv_heads}|"
                f"D{lo.head_dim}|T{lo.block_tokens}|{lo.dtype}|tp{self.tp_rank}/{self.tp_size}")
        if lo.kind != "kv":
            text += f"|{lo.kind}"
        return hashlib.blake2b(text.encode(), digest_size=FINGERPRINT_BYTES).digest()

    def to_dict(self) -> dict:
        """Plain fields for the wire."""
        return {"model": self.model, "layout": self.layout.to_dict(), "tp_rank": self.tp_rank,
                "tp_size": self.tp_size, "format_version": self.format_version}

    @classmethod
    def from_dict(cls, d: dict) -> Namespace:
        """Inverse of :meth:`to_dict`; raises ``ValueError`` on bad fields."""
        try:
            return cls(str(d["model"]), Layout.from_dict(d["layout"]), int(d.get("tp_rank", 0)),
                       int(d.get("tp_size", 1)), int(d.get("format_version", FORMAT_VERSION)))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"bad namespace {d!r}: {exc}") from exc


def chain_keys(fingerprint: bytes, token_ids: Sequence[int] | np.ndarray, block_tokens: int,
               parent: bytes | None = None) -> list[bytes]:
    """Chained keys of the full blocks of ``token_ids`` (a trailing partial block gets no key).

    Args:
        fingerprint: the namespace fingerprint.
        token_ids: the prompt's token ids.
        block_tokens: tokens per block.
        parent: the key of the block before ``token_ids[0]`` when continuing a chain.
    """
    tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    if parent is not None and (not isinstance(parent, bytes) or not parent):
        raise ValueError("parent must be a non-empty bytes key")
    keys: list[bytes] = []
    prev = parent if parent is not None else b"\x00" * KEY_BYTES
    for i in range(len(tokens) // block_tokens):
        h = hashlib.blake2b(digest_size=KEY_BYTES, key=fingerprint)
        h.update(prev)
        h.update(tokens[i * block_tokens:(i + 1) * block_tokens].tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys

"""Namespace fingerprints and chained block keys.

A namespace is the model's identity (a digest of its weights and of every setting that changes K or V:
:mod:`tierkv.client.identity`), layout (its kind included), tensor-parallel rank and size, and format
version; its 16-byte fingerprint is part of every stored key and is written into every encoded block, so
a block is never served to weights it does not belong to. The model id is a readable label: it decides
the fingerprint only where no identity is given (a client that asserts its model by name). Block keys
chain over the prefix: ``key_i = H(ns, key_(i-1), tokens_i[, extra_i])``, so equal keys mean equal
prefixes; ``extra_i`` carries what a block's KV depends on beyond its token ids (images, prompt
embeddings).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tierkv.core.layout import Layout

FORMAT_VERSION = 2  # 2: the model's identity, not its name, decides the fingerprint
KEY_BYTES = 16
FINGERPRINT_BYTES = 16
MAX_KEY_BYTES = 128  # engines may bring opaque keys up to this size (LMDB allows 511 with the prefix)
MAX_IDENTITY_CHARS = 256


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that makes KV of one model incompatible with another's."""

    model: str
    layout: Layout
    tp_rank: int = 0
    tp_size: int = 1
    format_version: int = FORMAT_VERSION
    identity: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model or len(self.model) > 256:
            raise ValueError("model must be a non-empty string of at most 256 characters")
        if not (0 <= self.tp_rank < self.tp_size):
            raise ValueError(f"tp_rank {self.tp_rank} out of range for tp_size {self.tp_size}")
        if not isinstance(self.identity, str) or len(self.identity) > MAX_IDENTITY_CHARS \
                or not self.identity.isprintable():
            raise ValueError(f"identity must be a printable string of at most {MAX_IDENTITY_CHARS} characters")
        if self.format_version != FORMAT_VERSION:
            raise ValueError(f"namespace format {self.format_version} is not this tierkv's ({FORMAT_VERSION}): "
                             "run the same tierkv version in the engine and the daemon")

    @property
    def fingerprint(self) -> bytes:
        """16-byte digest of the identity (the model id where none is given), layout and TP rank and
        size; stored with each block."""
        lo = self.layout
        who = f"id:{self.identity}" if self.identity else f"name:{self.model}"
        text = (f"tierkv/ns/v{self.format_version}|{who}|L{lo.num_layers}|H{lo.num_kv_heads}|"
                f"D{lo.head_dim}|T{lo.block_tokens}|{lo.dtype}|tp{self.tp_rank}/{self.tp_size}")
        if lo.kind != "kv":
            text += f"|{lo.kind}"
        return hashlib.blake2b(text.encode(), digest_size=FINGERPRINT_BYTES).digest()

    def to_dict(self) -> dict:
        """Plain fields for the wire."""
        return {"model": self.model, "layout": self.layout.to_dict(), "tp_rank": self.tp_rank,
                "tp_size": self.tp_size, "format_version": self.format_version, "identity": self.identity}

    @classmethod
    def from_dict(cls, d: dict) -> Namespace:
        """Inverse of :meth:`to_dict`; raises ``ValueError`` on bad fields (another format version too)."""
        try:
            return cls(str(d["model"]), Layout.from_dict(d["layout"]), int(d.get("tp_rank", 0)),
                       int(d.get("tp_size", 1)), int(d.get("format_version", 1)), str(d.get("identity", "")))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"bad namespace {d!r}: {exc}") from exc


def chain_keys(fingerprint: bytes, token_ids: Sequence[int] | np.ndarray, block_tokens: int,
               parent: bytes | None = None, extras: Sequence[bytes | None] | None = None) -> list[bytes]:
    """Chained keys of the full blocks of ``token_ids`` (a trailing partial block gets no key).

    Args:
        fingerprint: the namespace fingerprint.
        token_ids: the prompt's token ids.
        block_tokens: tokens per block.
        parent: the key of the block before ``token_ids[0]`` when continuing a chain.
        extras: per block, what its KV depends on beyond its token ids (a digest of its images or
            prompt embeddings), or None; hashed after the block's tokens, so a block with an extra
            never shares a key with one without.
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
        extra = extras[i] if extras is not None and i < len(extras) else None
        if extra:
            h.update(b"\x01extra")  # tokens are a fixed length: nothing before this can read as it
            h.update(extra)
        prev = h.digest()
        keys.append(prev)
    return keys


def salt_root(fingerprint: bytes, salt: str | None, adapter: str | None = None) -> bytes | None:
    """The parent key a request's chain starts from: None (the shared root) without a salt or an adapter,
    else a digest of them under the namespace, so tenants with different salts, and requests through
    different adapters (or none), share no key."""
    if adapter:
        text = b"tierkv/adapter|" + adapter.encode() + (b"|cache_salt|" + salt.encode() if salt else b"")
        return hashlib.blake2b(text, digest_size=KEY_BYTES, key=fingerprint).digest()
    if not salt:
        return None
    return hashlib.blake2b(b"tierkv/cache_salt|" + salt.encode(), digest_size=KEY_BYTES,
                           key=fingerprint).digest()

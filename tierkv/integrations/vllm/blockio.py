"""What the connector moves between tierkv and vLLM's pages: one request's blocks of one KV cache group
(:class:`BlockIO`), and one step's loads, stores and released requests (:class:`StepPlan`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

__all__ = ["BlockIO", "StepPlan", "tenant_of"]


@dataclass(slots=True)
class BlockIO:
    """Blocks of one request and one KV cache group to move between tierkv (``keys``) and vLLM
    (``block_ids``).

    ``wait_s`` marks an asynchronous load: the most seconds it may take before what arrived is used and
    the rest recomputed (None: a load inside the step, or a store). ``parent``: the key ``keys[0]``
    continues in its request's chain (None: the chain's first block). ``tokens``: a store's token ids
    (int32 bytes, ``block_tokens`` per key), for the daemon's KV events. ``group``: the KV cache group.
    ``lead``: blocks of the load before ``keys[0]`` that the group never reads (outside its sliding
    window: vLLM's null block stands there), served without being moved. ``first``: a store's position
    of ``keys[0]`` in its request's chain. ``tenant``: a store's tenant (the request's ``cache_salt``),
    whose quotas in the daemon count its blocks."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    wait_s: float | None = None
    parent: bytes | None = None
    tokens: bytes | None = None
    group: int = 0
    lead: int = 0
    first: int = 0
    tenant: str | None = None


@dataclass(slots=True)
class StepPlan:
    """What the worker does in one step: loads before the forward pass, stores after it; ``release``:
    finished requests whose pages vLLM holds for this step's stores, to free once they ran."""

    loads: list[BlockIO] = field(default_factory=list)
    stores: list[BlockIO] = field(default_factory=list)
    release: list[str] = field(default_factory=list)


def tenant_of(salt: str | None) -> str | None:
    """The tenant a request's blocks are stored for: its ``cache_salt`` (a digest of one longer than the
    daemon takes)."""
    if not salt:
        return None
    return salt if len(salt) <= 256 else "salt:" + hashlib.blake2b(salt.encode(), digest_size=16).hexdigest()

"""Which blocks of a step's stores tierkv does not hold yet: only those are gathered and committed.

The question is answered from the daemon's shared lookup index, mapped by the client (no round trip).
A block the index holds is skipped: not copied out of vLLM's pages, given no slot, and named in the
commit as a use (the daemon counts it as one, as it counts a lease, so its eviction order is what a
request that used the block makes it). Each run of missing blocks continues the block before it, the
skipped one included, so the daemon's chains stay whole. The answer is a hint: a block that leaves
between the check and the commit leaves a hole in its chain (a later miss), and one that arrives
meanwhile is deduplicated at the commit; no key is ever committed without its own bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tierkv.integrations.vllm.blockio import BlockIO

__all__ = ["Missing", "missing"]

# keys -> per key, whether tierkv holds it; None when that cannot be told now (every key is stored)
Held = Callable[[list[bytes]], list[bool] | None]


@dataclass(slots=True)
class Missing:
    """The blocks of a step's stores to gather and commit, and the cached ones skipped."""

    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    chains: list[tuple[int, bytes | None]] = field(default_factory=list)  # (index into keys, parent)
    tokens: np.ndarray | None = None  # token ids of ``keys`` (int32), when every store has them
    uses: list[bytes] = field(default_factory=list)  # cached blocks skipped: a use each at the commit
    tenants: list[tuple[int, str | None]] = field(default_factory=list)  # (index into keys, tenant) where one starts
    skipped: int = 0  # blocks not stored because tierkv holds them (``uses``, and repeats within the step)

    @property
    def total(self) -> int:
        """Every block of the stores."""
        return len(self.keys) + self.skipped


def missing(stores: Sequence[BlockIO], held: Held) -> Missing:
    """Split ``stores`` (one :class:`BlockIO` per request) into the blocks to store and those tierkv
    holds (``held``, asked once per request). A key that an earlier request of the same step stores
    is stored once."""
    out, taken, parts = Missing(), set(), []
    with_tokens = all(io.tokens is not None for io in stores if io.keys)
    for io in stores:
        if not io.keys:
            continue
        flags = held(io.keys) or [False] * len(io.keys)
        per = len(io.tokens) // len(io.keys) if io.tokens is not None else 0
        after = True  # the block before was skipped (or is the request's parent): a new chain starts
        for i, (key, block, cached) in enumerate(zip(io.keys, io.block_ids, flags)):
            if cached or key in taken:
                out.skipped += 1
                if cached and key not in taken:
                    out.uses.append(key)
                    taken.add(key)
                after = True
                continue
            if after:
                out.chains.append((len(out.keys), io.keys[i - 1] if i else io.parent))
            if io.tenant != (out.tenants[-1][1] if out.tenants else None):
                out.tenants.append((len(out.keys), io.tenant))
            out.keys.append(key)
            out.block_ids.append(block)
            taken.add(key)
            if with_tokens and io.tokens is not None:
                parts.append(io.tokens[i * per:(i + 1) * per])
            after = False
    if with_tokens and out.keys:
        out.tokens = np.frombuffer(b"".join(parts), dtype="<i4")
    return out

"""Windows: which blocks of a live sequence stay in host memory when it must fit a budget.

Attention sinks (the first blocks) and the recent tail always stay; of the middle, the blocks with the
most attention mass the client reported stay; the rest are demoted (never dropped).
"""

from __future__ import annotations

from tierkv.cache.block import Block


def window_out(seq: list[Block | None], budget: int, sinks: int, recent: int) -> list[Block]:
    """Blocks of ``seq`` (records in sequence order, None where not cached) to move out of host memory.

    Args:
        seq: the sequence's records.
        budget: host blocks the sequence may keep.
        sinks: leading blocks always kept.
        recent: trailing blocks always kept.

    Returns:
        The host-resident blocks to demote, in sequence order (blocks in use are never chosen).
    """
    resident = [(i, b) for i, b in enumerate(seq) if b is not None and b.host_off is not None]
    if len(resident) <= budget:
        return []
    n = len(seq)
    fixed = {i for i, _ in resident if i < sinks or i >= n - recent}
    middle = sorted((b.mass, -i, i) for i, b in resident if i not in fixed)
    room = max(0, budget - len(fixed))
    keep = fixed | {i for _m, _ni, i in middle[len(middle) - room:]} if room else fixed
    return [b for i, b in resident if i not in keep and not b.protected]

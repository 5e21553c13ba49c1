"""A victim walk in a given order that keeps prefix chains whole: a block is taken only once none of its
children stays in the tier, so chains shrink from the tail whatever the order ranks first."""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Mapping

from tierkv.cache.policy.base import Protected


def walk_tails_in_order(order: Iterable[Hashable], size: Mapping[Hashable, int], kids: Mapping[Hashable, int],
                        parent: Mapping[Hashable, Hashable], nbytes: int,
                        protected: Protected) -> list[Hashable] | None:
    """Take unprotected blocks in ``order`` (best victim first) until ``nbytes`` are covered.

    A block met while children of it stay (``kids``: resident children per key, ``parent``: each key's
    parent) waits; it is taken once its last child was, at its own place among the waiting ones. A
    protected block keeps its parent. Returns the keys, or None if they never cover ``nbytes``.
    """
    if nbytes <= 0:
        return []
    out: list[Hashable] = []
    got = 0
    taken_kids: dict[Hashable, int] = {}
    waiting: dict[Hashable, int] = {}  # key -> its place in the order, while children of it stay
    ready: list[tuple[int, Hashable]] = []  # waiting keys whose children were all taken
    walk = enumerate(order)
    nxt = next(walk, None)
    while got < nbytes:
        if ready and (nxt is None or ready[0][0] < nxt[0]):
            _, key = heapq.heappop(ready)
        elif nxt is not None:
            rank, key = nxt
            nxt = next(walk, None)
            if kids.get(key, 0) > taken_kids.get(key, 0):
                waiting[key] = rank
                continue
        else:
            break
        if protected(key):
            continue
        out.append(key)
        got += size[key]
        up = parent.get(key)
        if up is not None and up in size:
            taken_kids[up] = taken_kids.get(up, 0) + 1
            if taken_kids[up] == kids.get(up, 0) and up in waiting:
                heapq.heappush(ready, (waiting.pop(up), up))
    return out if got >= nbytes else None

"""Tensor parallelism on the scheduler side: each worker rank stores its own heads under its own
namespace, so a block counts as cached, and as ready in host memory, only when every rank holds it.

The scheduler keeps one connection per rank and KV cache group; every rank's lookup reads the daemon's
shared lookup index, so asking each rank costs no round trip. The answers merge by the minimum: the
hit is the fewest leading blocks any rank holds, a block is ready when it is ready for every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tierkv.core.errors import TierKVError
from tierkv.integrations.vllm.link import Link

__all__ = ["ask_ranks", "merge_plans"]

T = TypeVar("T")


def ask_ranks(links: Sequence[Link], fn: Callable[[Any], T]) -> list[T] | None:
    """``fn(client)`` on every rank's connection, in rank order; None when the daemon cannot answer for
    some rank (a failed connection is dropped and made again later)."""
    out: list[T] = []
    for link in links:
        try:
            r = link.call(fn)
        except TierKVError as exc:
            link.drop(exc)
            return None
        if r is None:
            return None
        out.append(r)
    return out


def merge_plans(plans: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One ``lookup_plan`` answer for all ranks: the fewest cached blocks (``count``) and blocks worth
    fetching (``fetch``) of any rank, a block ready only where every rank has it in host memory, and the
    first rank's ``tiers`` and cost ``runs`` (the ranks' recompute costs are the same tokens)."""
    if len(plans) == 1:
        return plans[0]
    count = min(int(p["count"]) for p in plans)
    ready = [all(bool(p["ready"][i]) for p in plans) for i in range(count)]
    return {**plans[0], "count": count, "fetch": min(int(p["fetch"]) for p in plans), "ready": ready,
            "tiers": list(plans[0].get("tiers", []))[:count]}


def finished(c: Any, keys: list[bytes], out: int | None) -> int:
    """Tell one rank's daemon connection that a request ended (its chain ``keys``, tokens generated)."""
    return int(c.request_finished(keys, out))

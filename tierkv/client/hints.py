"""What a client tells the daemon beside its blocks (attention mass, pinned prefixes, sequence windows)
and what it asks of it (figures, health): the connection's calls that move no K/V."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tierkv.client.checks import check_keys
from tierkv.client.connection import Connection
from tierkv.core.errors import BadRequest
from tierkv.core.protocol import Op

__all__ = ["Hints"]


class Hints(Connection):
    """Hints and introspection over one connection (the base of :class:`~tierkv.client.client.Client`)."""

    def touch(self, keys: Sequence[bytes], scores: Sequence[float]) -> int:
        """Report attention mass per block (1.0 = uniform) for placement; returns blocks found."""
        keys = check_keys(keys)
        scores = [float(x) for x in scores]
        if len(scores) != len(keys):
            raise BadRequest("scores must be as long as keys")
        return int(self._call(Op.TOUCH, {"keys": keys, "scores": scores})["touched"])

    def pin_prefix(self, keys: Sequence[bytes], priority: int = 80) -> int:
        """Keep a frozen prefix (system prompt, tool descriptions) in the host tier until :meth:`unpin`.

        Args:
            keys: the prefix's block keys (blocks must already be stored; missing ones end the prefix).
            priority: retention priority 1..100, as in TensorRT-LLM's retention config.

        Returns:
            How many leading blocks are now pinned.
        """
        return int(self._call(Op.PIN, {"keys": check_keys(keys), "priority": priority})["pinned"])

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Make pinned blocks evictable again; returns how many were pinned."""
        return int(self._call(Op.UNPIN, {"keys": check_keys(keys)})["unpinned"])

    def set_window(self, keys: Sequence[bytes], budget: int, sinks: int = 1, recent: int = 8) -> int:
        """Fit a live sequence longer than its fast-tier budget: keep the first ``sinks`` blocks
        (attention sinks), the last ``recent`` blocks, and the middle blocks with the most attention
        mass (see :meth:`touch`) up to ``budget`` blocks in host memory; the rest are demoted to disk,
        never dropped. Returns how many blocks were demoted."""
        return int(self._call(Op.WINDOW, {"keys": check_keys(keys), "budget": budget, "sinks": sinks,
                                          "recent": recent})["demoted"])

    def offer(self, offers: Sequence[tuple[bytes | None, Sequence[bytes], int, bool]]) -> list[int]:
        """Ask the daemon's store gate which of requests' new blocks are worth storing.

        Args:
            offers: per request ``(root, keys, first, cut)``: the key its chain starts from (its
                ``cache_salt`` or adapter root; None: the shared root), its new blocks' keys, the
                position of the first of them in its chain, and whether the request stopped storing
                earlier (its blocks are offered only for the gate to learn from).

        Returns:
            Per offer, how many leading keys to store (the rest are skipped as unlikely to pay).
        """
        body = [[root, check_keys(keys), int(first), bool(cut)] for root, keys, first, cut in offers]
        return [int(n) for n in self._call(Op.OFFER, {"offers": body})["store"]]

    def stats(self) -> dict[str, Any]:
        """The daemon's figures: per tier capacity, usage, hits, misses, bytes, evictions, ..."""
        return self._call(Op.STATS, {})

    def health(self) -> dict[str, Any]:
        """``{"status": "ok" | "degraded", "reason": ...}``."""
        return self._call(Op.HEALTH, {})

    def ping(self) -> dict[str, Any]:
        """Round trip to the daemon."""
        return self._call(Op.PING, {})

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

    def offer(self, offers: Sequence[tuple[bytes | None, Sequence[bytes], int, bool]
                                    | tuple[bytes | None, Sequence[bytes], int, bool, str | None]]
              ) -> list[tuple[int, int]]:
        """Ask the daemon's store gate which of requests' new blocks are worth storing.

        Args:
            offers: per request ``(root, keys, first, cut)``: the key its chain starts from (its
                ``cache_salt`` or adapter root; None: the shared root), its new blocks' keys, the
                position of the first of them in its chain, and whether the request stopped storing
                earlier (its blocks are offered only for the gate to learn from); optionally the
                request's tenant (whose misses they are).

        Returns:
            Per offer, how many leading keys to store now (the rest are skipped as unlikely to pay) and
            how many if the engine has no other request when this one ends (at least as many; the idle
            run continues only the request's earlier idle run).
        """
        body = [[o[0], check_keys(o[1]), int(o[2]), bool(o[3]), *o[4:]] for o in offers]
        reply = self._call(Op.OFFER, {"offers": body})
        now = [int(n) for n in reply["store"]]
        return list(zip(now, [int(n) for n in reply.get("idle", now)]))

    def set_clock(self, seconds: float) -> None:
        """Move the clock a daemon started with ``server.synchronous`` decides on (its policies,
        reuse models and admission rule) to ``seconds`` (never backwards): a trace fed to it request by
        request is decided on the trace's clock, as ``tierkv replay`` decides it."""
        self._call(Op.CLOCK, {"now": seconds})

    def stats(self) -> dict[str, Any]:
        """The daemon's figures: per tier capacity, usage, hits, misses, bytes, evictions, ..."""
        return self._call(Op.STATS, {})

    def health(self) -> dict[str, Any]:
        """``{"status": "ok" | "degraded", "reason": ...}``."""
        return self._call(Op.HEALTH, {})

    def ping(self) -> dict[str, Any]:
        """Round trip to the daemon."""
        return self._call(Op.PING, {})

    def request_finished(self, keys: Sequence[bytes], output_tokens: int | None = None) -> int:
        """Tell the daemon a request finished: ``keys`` (its chained block keys, prompt and output, in
        order) are a conversation tail the next turn may extend, so the daemon keeps them (writes them
        to disk when they leave host memory). ``output_tokens``: how many tokens the request
        generated; requests that generate little and those that generate much come back at different
        rates, which the daemon learns. Returns how many of the keys are cached."""
        body: dict = {"keys": check_keys(keys)}
        if output_tokens is not None:
            if isinstance(output_tokens, bool) or not isinstance(output_tokens, int) or output_tokens < 0:
                raise ValueError(f"output_tokens must be an int >= 0, got {output_tokens!r}")
            body["output_tokens"] = output_tokens
        return int(self._call(Op.REQUEST_FINISHED, body)["cached"])

    def lookup_plan(self, keys: Sequence[bytes]) -> dict[str, Any]:
        """Per leading cached block: ``tiers``, ``ready`` (in host memory now), and ``fetch``: how many
        leading blocks are worth fetching rather than recomputing, from the daemon's measured tier
        speeds and the recompute speed reported with :meth:`report_recompute`; ``prefix_recompute_s``:
        the seconds recomputing the first 1, 2, ... of ``keys`` would take, and ``recompute_source``:
        ``measured``, ``engine`` or ``prior`` (the daemon's default: nothing reported yet)."""
        return self._call(Op.PLAN, {"keys": check_keys(keys)})

    def report_recompute(self, tokens: int, seconds: float) -> float:
        """Tell the cost model how fast this engine prefills (``tokens`` in ``seconds``)."""
        return float(self._call(Op.RECOMPUTE, {"tokens": int(tokens), "seconds": float(seconds)})["tokens_per_s"])

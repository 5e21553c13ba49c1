"""The scheduler side's question to the daemon's store gate (:mod:`tierkv.cache.store_gate`): which of a
step's new blocks are worth storing.

Once per step that stores, every request's new blocks (its first KV cache group's keys, with the root
its chain starts from and the position of the first) go to the daemon in one round trip; the answer
is, per request, how many leading blocks to store, and how many if the engine is idle when the request
ends. The others are not copied out of vLLM's pages, not committed and never written to disk; and since
a chain is read back only through its prefix, a request stores nothing more once one of its blocks was
skipped (its later blocks are still offered, for the gate to learn from) until it ends: then, with no
other request waiting or running, the planner stores the run the gate kept for an idle engine. A
daemon without a store gate answers with an error: every block is then stored.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tierkv.core.errors import TierKVError
from tierkv.integrations.vllm.link import Link

log = logging.getLogger("vllm.tierkv")

__all__ = ["StoreOffers"]


class StoreOffers:
    """Offers a step's new blocks to the store gate and trims the stores to what it keeps.

    Args:
        link: the scheduler's connection (the first group's namespace, tensor-parallel rank 0).
        block_tokens: tokens per block (a store's token ids are trimmed with its keys).
    """

    def __init__(self, link: Link, block_tokens: int) -> None:
        self.link, self.block_tokens = link, block_tokens
        self.on = True
        self.offered = 0  # blocks offered
        self.gated = 0    # of those, not stored: unlikely to pay

    def trim(self, stores: list[Any], requests: Mapping[str, Any]) -> list[Any]:
        """The stores (:class:`~tierkv.integrations.vllm.plan.BlockIO`, every group's) to run: each
        request's leading run the gate keeps. ``requests`` maps a request id to its state (``roots``;
        ``cut_at`` and ``idle_to``, set here: where the gate first skipped one of its blocks, and the end
        of the run after it that an idle engine stores)."""
        if not self.on:
            return stores
        heads = [io for io in stores if io.group == 0]
        offers = [(requests[io.req_id].roots[0], io.keys, io.first, requests[io.req_id].cut, io.tenant)
                  for io in heads]
        try:
            answer = self.link.call(lambda c: c.offer(offers))
        except TierKVError as exc:
            log.warning("tierkv: the daemon has no store gate (%s); every new block is stored", exc)
            self.on = False
            return stores
        if answer is None:
            return stores  # the daemon is away: the stores fail and are counted
        keep = {io.req_id: n for io, (n, _) in zip(heads, answer)}
        for io, (n, idle) in zip(heads, answer):
            st = requests[io.req_id]
            if st.cut_at is None and n < len(io.keys):
                st.cut_at, st.idle_to = io.first + n, io.first + idle
            elif st.cut_at is not None and st.idle_to == io.first:  # the idle run goes on
                st.idle_to = io.first + idle
        kept = []
        for io in stores:
            n = keep.get(io.req_id, len(io.keys))
            if io.group == 0:
                self.offered += len(io.keys)
                self.gated += len(io.keys) - n
            if n < len(io.keys):
                io.keys, io.block_ids = io.keys[:n], io.block_ids[:n]
                if io.tokens is not None:
                    io.tokens = io.tokens[:n * self.block_tokens * 4]
            if io.keys:
                kept.append(io)
        return kept

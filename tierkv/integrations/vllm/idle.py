"""Stores an idle engine makes: the run of a finished request that the store gate kept for an idle
engine (:meth:`tierkv.cache.store_gate.StoreGate.decide`).

A request that ends with no other request waiting or running has its run stored by the next step, an
empty one, out of the pages vLLM keeps for it until the worker reports the request as sent. One that
ends while others run has its pages held for the first step with no request left, while vLLM's KV
cache is at most half full (held pages are room running requests cannot use); held runs are given up,
oldest first and unstored, once the cache is more than three quarters full. A busy engine never copies
a run inside a step that computes.
"""

from __future__ import annotations

from collections.abc import Callable

from tierkv.integrations.vllm.blockio import BlockIO

__all__ = ["IdleStores"]

HOLD_BELOW = 0.5  # vLLM's KV cache usage under which a finished request's pages are held for an idle step
GIVE_UP_ABOVE = 0.75  # usage over which held pages are given back unstored, oldest first


class IdleStores:
    """Finished requests' runs waiting for an idle step, and those the next step stores.

    Args:
        usage: vLLM's KV cache usage, 0..1 (None: unknown, nothing is held past a busy end).
    """

    def __init__(self, usage: Callable[[], float] | None = None) -> None:
        self.usage = usage
        self._held: dict[str, list[BlockIO]] = {}
        self._ready: list[BlockIO] = []
        self._release: list[str] = []
        self.stored = 0  # blocks stored idle (the first group's)
        self.given_up = 0  # blocks held and given back unstored

    def finished(self, req_id: str, run: list[BlockIO], idle: bool) -> None:
        """Request ``req_id`` ended with ``run`` (every group's part) to store if the engine is idle;
        ``idle``: no other request waits or runs."""
        if not run:
            return
        if idle:
            self._store(req_id, run)
        elif self.usage is not None and self.usage() <= HOLD_BELOW:
            self._held[req_id] = run

    def take(self, idle: bool) -> tuple[list[BlockIO], list[str]]:
        """This step's stores and the finished requests whose pages vLLM may free after it; ``idle``:
        the step runs no request (held runs are stored)."""
        if idle:
            for req_id, run in list(self._held.items()):
                self._store(req_id, run)
            self._held.clear()
        else:
            while self._held and self.usage is not None and self.usage() > GIVE_UP_ABOVE:
                req_id = next(iter(self._held))
                self.given_up += sum(len(io.keys) for io in self._held.pop(req_id) if io.group == 0)
                self._release.append(req_id)
        out = self._ready, self._release
        self._ready, self._release = [], []
        return out

    def holds(self, req_id: str) -> bool:
        """Whether vLLM must keep this finished request's pages (a later step stores from them)."""
        return req_id in self._held or req_id in self._release

    def _store(self, req_id: str, run: list[BlockIO]) -> None:
        self._ready.extend(run)
        self._release.append(req_id)
        self.stored += sum(len(io.keys) for io in run if io.group == 0)

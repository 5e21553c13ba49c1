"""Stores whose step costs only the copy: slots taken from a reservoir allocated ahead, commits sent
from a thread of their own.

The store pass of a step takes free slots this worker allocated earlier (allocating the shortfall at
once, without waiting for room), copies vLLM's pages into them and hands them to the committer; the
committer's thread waits for the copy (a CUDA event on a GPU), commits, and refills the reservoir for
the next step. A slot belongs to the connection that allocated it: when the daemon goes away the
reservoir is dropped with the connection.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tierkv.client.client import Client
from tierkv.client.slots import Slots
from tierkv.core.errors import TierFull, TierKVError
from tierkv.integrations.vllm.link import Link

log = logging.getLogger("vllm.tierkv")

__all__ = ["Committed", "StoreCommitter"]

RESERVOIR_SHARE = 1 / 16  # free slots held ahead: at most this share of the host pool
RECENT_STEPS = 16         # the reservoir aims at the largest store of this many recent steps

# A submitted commit: client, keys, slots, the copy's ready event, prefix chains, token ids, uses.
_Item = tuple[Client, list[bytes], Slots, Any, Sequence[tuple[int, bytes | None]] | None, Any, Sequence[bytes],
              Sequence[tuple[int, str | None]]]


@dataclass(slots=True)
class Committed:
    """What the committer's thread did since it was last asked (added to the connector's counters)."""

    stored_tokens: int = 0
    new_blocks: int = 0
    store_errors: int = 0
    store_skipped: int = 0


class StoreCommitter:
    """Slots ahead of need and commits off the step.

    Args:
        link: the worker's connection (the one whose slots these are).
        block_tokens: tokens per block (for the counters).
    """

    def __init__(self, link: Link, block_tokens: int) -> None:
        self.link, self.block_tokens = link, block_tokens
        self._lock = threading.Lock()
        self._free: list[int] = []            # offsets allocated on ``self._owner``, not handed out
        self._owner: Client | None = None
        self._recent: deque[int] = deque(maxlen=RECENT_STEPS)
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._done = Committed()
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="tierkv-commit", daemon=True)
        self._thread.start()

    def slots(self, client: Client, n: int, keep: Sequence[bytes] = ()) -> Slots:
        """``n`` slots of ``client`` for this step: from the reservoir, the shortfall allocated now
        (never waiting for room, evicting none of ``keep``: cached blocks the step skips).

        Raises:
            TierFull: the host tier has no block to spare right now.
        """
        with self._lock:
            if self._owner is not client:
                self._owner, self._free = client, []
            self._recent.append(n)
            take, self._free = self._free[:n], self._free[n:]
        if len(take) < n:
            try:
                more = client.alloc(n - len(take), timeout=0, keep=keep)
            except TierKVError:
                with self._lock:  # the reservoir's slots stay reserved for a next step
                    if self._owner is client:
                        self._free = take + self._free
                raise
            more._open = False  # handed to the caller's Slots below
            take += more.offsets
        return Slots(client, take)

    def submit(self, client: Client, keys: list[bytes], slots: Slots, ready: Any = None,
               chains: Sequence[tuple[int, bytes | None]] | None = None, tokens: Any = None,
               uses: Sequence[bytes] = (), tenants: Sequence[tuple[int, str | None]] = ()) -> None:
        """Commit ``slots`` under ``keys`` (prefix chains starting at ``chains``, and ``uses``, the
        cached blocks skipped, and ``tenants``: see :meth:`Client.commit`) on the committer's thread once ``ready`` (a
        CUDA event, or None when the copy is done) has completed."""
        with self._lock:
            self._pending += 1
        self._queue.put((client, keys, slots, ready, chains, tokens, uses, tenants))

    def take(self) -> Committed:
        """The counters since the last call."""
        with self._lock:
            out, self._done = self._done, Committed()
        return out

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every submitted commit ran; False if ``timeout`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        """Stop the thread after the commits already submitted."""
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            client, keys, slots, ready, chains, tokens, uses, tenants = item
            try:
                if ready is not None:
                    ready.synchronize()
                new = slots.commit(keys, chains=chains, tokens=tokens, uses=uses, tenants=tenants)
                result = Committed(stored_tokens=len(keys) * self.block_tokens, new_blocks=new)
            except TierKVError as exc:
                log.debug("tierkv: a background commit failed: %s", exc)
                result = Committed(store_errors=len(keys))
                if not isinstance(exc, TierFull):
                    self.link.drop(exc)
            except Exception as exc:  # noqa: BLE001 - the thread must outlive any one commit
                log.warning("tierkv: a background commit failed: %s", exc)
                result = Committed(store_errors=len(keys))
            self._refill(client)
            with self._lock:
                for f in ("stored_tokens", "new_blocks", "store_errors", "store_skipped"):
                    setattr(self._done, f, getattr(self._done, f) + getattr(result, f))
                self._pending -= 1
                self._idle.notify_all()

    def _refill(self, client: Client) -> None:
        """Allocate ahead what the largest recent step stored, within the reservoir's share."""
        with self._lock:
            if self._owner is not client:
                return
            cap = int(client._pool_bytes * RESERVOIR_SHARE) // max(1, client.layout.block_bytes)
            want = min(max(self._recent, default=0), cap) - len(self._free)
        if want <= 0:
            return
        try:
            more = client.alloc(want, timeout=0)
        except TierKVError:
            return  # no room to spare: the next step allocates what it needs itself
        more._open = False
        with self._lock:
            if self._owner is client:
                self._free += more.offsets
                return
        try:  # the connection changed meanwhile: these slots go back with the old one
            Slots(client, more.offsets).abort()
        except TierKVError:
            pass

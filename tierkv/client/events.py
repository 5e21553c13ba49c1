"""A KV-events subscriber: the per-tier index of what a daemon holds, rebuilt from its events.

It reads vLLM's KV-events wire format (what ``tierkv serve --kv-events`` publishes, and what vLLM's
own ``--kv-events-config`` publishes), so a router written in Python can keep one index per node:

    index = EventIndex("tcp://node1:5557", replay="tcp://node1:5558").start()
    index.held("CPU")              # {block hash: token ids}
    index.prefix_blocks(hashes)    # per medium: how many leading blocks of a chain it holds

On start, and at each gap in sequence numbers (a lost message, a daemon restart), it asks the replay
endpoint for the batches it has not seen; a daemon's restart sends ``AllBlocksCleared`` first, which
empties the index.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

END_SEQ = -1


class EventIndex:
    """Blocks per medium (``GPU``, ``CPU``, ``DISK``, ``REMOTE``), from a publisher's events."""

    def __init__(self, endpoint: str, replay: str | None = None, topic: str = "", idle_replay_s: float = 1.0) -> None:
        """Args:
            endpoint: the publisher's PUB endpoint (connected to).
            replay: its ROUTER replay endpoint, or None (gaps are then only counted).
            topic: the topic to subscribe to.
            idle_replay_s: after this long without a message, ask the replay endpoint for anything
                newer (a PUB socket drops silently what it sends before a subscriber reconnects, e.g.
                a restarted daemon's first batches).
        """
        self.endpoint, self.replay, self.topic, self.idle_replay_s = endpoint, replay, topic, idle_replay_s
        self.index: dict[str, dict[bytes, list[int]]] = {}
        self.last_seq: int | None = None
        self.batches = 0
        self.events = 0
        self.gaps = 0        # jumps in sequence numbers applied across (a publisher's restart)
        self.lag_s: list[float] = []   # publish timestamp to arrival, per batch
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tierkv-event-index", daemon=True)

    def start(self, timeout: float = 5.0) -> EventIndex:
        """Connect and start applying events; returns once subscribed."""
        self._thread.start()
        self._ready.wait(timeout)
        return self

    def close(self) -> None:
        """Stop the subscriber thread."""
        self._stop.set()
        self._thread.join(5)

    def held(self, medium: str) -> dict[bytes, list[int]]:
        """A copy of one medium's blocks: hash -> token ids."""
        with self.lock:
            return dict(self.index.get(medium, {}))

    def counts(self) -> dict[str, int]:
        """Blocks per medium."""
        with self.lock:
            return {m: len(blocks) for m, blocks in self.index.items()}

    def prefix_blocks(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Per medium: how many leading blocks of ``hashes`` it holds."""
        out: dict[str, int] = {}
        with self.lock:
            for medium, blocks in self.index.items():
                n = 0
                while n < len(hashes) and hashes[n] in blocks:
                    n += 1
                out[medium] = n
        return out

    # ---- applying batches --------------------------------------------------------------------------
    def apply(self, seq: int, payload: bytes) -> None:
        """Apply one batch (in sequence order)."""
        ts, events = msgpack.unpackb(payload)[:2]
        with self.lock:
            if self.last_seq is not None and seq != self.last_seq + 1:
                self.gaps += 1  # lost batches or a restarted publisher (numbers jump forward)
            for ev in events:
                kind = ev.get("type")
                if kind == "AllBlocksCleared":
                    self.index.clear()
                elif kind == "BlockStored":
                    blocks = self.index.setdefault(ev.get("medium") or "", {})
                    ids, size = ev.get("token_ids") or [], ev.get("block_size") or 0
                    for i, h in enumerate(ev["block_hashes"]):
                        blocks[h] = ids[i * size:(i + 1) * size] if size else []
                elif kind == "BlockRemoved":
                    blocks = self.index.setdefault(ev.get("medium") or "", {})
                    for h in ev["block_hashes"]:
                        blocks.pop(h, None)
            self.last_seq = seq
            self.batches += 1
            self.events += len(events)
            self.lag_s.append(time.time() - ts)

    def _run(self) -> None:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        self._replay(ctx, 0)  # what was published before this subscriber joined (as far as buffered)
        self._ready.set()
        quiet_since = time.monotonic()
        try:
            while not self._stop.is_set():
                if not sub.poll(50):
                    if time.monotonic() - quiet_since > self.idle_replay_s:
                        self._replay(ctx, 0 if self.last_seq is None else self.last_seq + 1)
                        quiet_since = time.monotonic()
                    continue
                quiet_since = time.monotonic()
                _, seq_b, payload = sub.recv_multipart()
                seq = int.from_bytes(seq_b, "big", signed=True)
                if self.last_seq is not None and seq <= self.last_seq:
                    continue  # already applied through a replay
                if self.last_seq is not None and seq != self.last_seq + 1:
                    self._replay(ctx, self.last_seq + 1)
                    if self.last_seq is not None and seq <= self.last_seq:
                        continue
                self.apply(seq, payload)
        finally:
            sub.close(linger=0)
            ctx.term()

    def _replay(self, ctx: zmq.Context, start: int) -> None:
        """Ask the replay endpoint for every batch from ``start``; apply them."""
        if self.replay is None:
            return
        sock = ctx.socket(zmq.DEALER)
        sock.connect(self.replay)
        try:
            sock.send_multipart((b"", start.to_bytes(8, "big", signed=True)))
            while sock.poll(5000):
                frames: list[Any] = sock.recv_multipart()
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == END_SEQ:
                    return
                if self.last_seq is None or seq > self.last_seq:
                    self.apply(seq, frames[-1])
        finally:
            sock.close(linger=0)

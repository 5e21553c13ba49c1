"""KV events: every tier copy a block gains or loses, published in vLLM's KV-events wire format.

A router (llm-d's indexer, Dynamo's, a fleet's own) keeps an index of which blocks each node holds
from these events. The wire format is vLLM's (``vllm.distributed.kv_events``): a ZMQ PUB socket sends
``(topic, seq as 8 bytes big-endian, payload)``, the payload a msgpack ``[ts, [event, ...]]`` with
each event a map tagged by ``type``: ``BlockStored`` (``block_hashes``, ``parent_block_hash``,
``token_ids``, ``block_size``, ``medium``, ...), ``BlockRemoved`` (``block_hashes``, ``medium``) or
``AllBlocksCleared``. Media are ``GPU``, ``CPU``, ``DISK`` and ``REMOTE``; every stored event also
names its ``namespace`` (model, tensor-parallel rank and size, dtype, fingerprint). A ROUTER socket
answers replay requests (a start sequence number as 8 bytes) from a buffer of recent batches, as
vLLM's publisher does. Sequence numbers start at the daemon's start time in microseconds, so they
only grow across restarts.

Each daemon start publishes ``AllBlocksCleared`` first, then a ``BlockStored`` for every block its
disk tier still holds; the token ids and parents of blocks on disk are kept for that in a small LMDB
beside the disk tier. The block table reports each change under the store's lock; one thread turns
them into batches every ``events.interval_ms``, so the request paths never wait for the sockets.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import lmdb
import msgpack
import numpy as np
import zmq

from tierkv.core.keys import FINGERPRINT_BYTES
from tierkv.daemon.config import EventsConfig

if TYPE_CHECKING:
    from tierkv.cache.table import BlockTable
from tierkv.cache.tier_changes import TierChanges

log = logging.getLogger("tierkv.events")

MEDIUM = {"gpu": "GPU", "host": "CPU", "disk": "DISK", "remote": "REMOTE"}
END_SEQ = (-1).to_bytes(8, "big", signed=True)
META_MAP_BYTES = 1 << 36  # address space of the token store (sparse; ~600 B per block on disk)


@dataclass
class EventCounters:
    """What the publisher has sent."""

    events: int = 0
    batches: int = 0
    seq: int = -1            # the last batch's sequence number
    lag_ms_last: float = 0.0  # from the change to its batch on the wire, for the oldest change of a batch
    lag_ms_max: float = 0.0
    replays: int = 0

    def to_dict(self) -> dict[str, object]:
        return {"events": self.events, "batches": self.batches, "seq": self.seq, "replays": self.replays,
                "lag_ms_last": round(self.lag_ms_last, 2), "lag_ms_max": round(self.lag_ms_max, 2)}


class TokenStore:
    """Token ids, parent and namespace of the blocks on disk, by ``fingerprint + key`` (LMDB)."""

    def __init__(self, path: Path) -> None:
        path.mkdir(mode=0o700, exist_ok=True)
        self.env = lmdb.open(str(path), map_size=META_MAP_BYTES, subdir=True, sync=False, metasync=False,
                             max_dbs=0, lock=True, mode=0o600)

    def get(self, fk: bytes) -> tuple[bytes | None, bytes, dict] | None:
        with self.env.begin() as txn:
            raw = txn.get(fk)
        if raw is None:
            return None
        parent, tokens, ns = msgpack.unpackb(raw)
        return parent, tokens, ns

    def write(self, ops: list[tuple[bytes, tuple[bytes | None, bytes, dict] | None]]) -> None:
        """Apply ``(fk, (parent, tokens, namespace))`` puts and ``(fk, None)`` deletes in order."""
        if not ops:
            return
        with self.env.begin(write=True) as txn:
            for fk, rec in ops:
                if rec is None:
                    txn.delete(fk)
                else:
                    txn.put(fk, msgpack.packb(list(rec)))

    def keep_only(self, keep: set[bytes]) -> int:
        """Drop the entries of blocks no longer on disk; returns how many."""
        with self.env.begin(write=True) as txn:
            stale = [k for k in txn.cursor().iternext(values=False) if k not in keep]
            for k in stale:
                txn.delete(k)
        return len(stale)

    def close(self) -> None:
        self.env.close()


class Publisher:
    """vLLM's ZMQ publisher protocol: PUB for batches, ROUTER for replays of the recent ones."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str, buffer_steps: int) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.set_hwm(100_000)
        self.replay: zmq.Socket | None = None
        self.topic = topic.encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        # numbers start at the start time in microseconds: a restart never reuses one, so a subscriber
        # sees a gap after a restart and asks for a replay (which begins with AllBlocksCleared)
        self.seq = time.time_ns() // 1000
        try:
            _attach(self.pub, endpoint)
            if replay_endpoint:
                self.replay = self.ctx.socket(zmq.ROUTER)
                self.replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"events: cannot open {endpoint} / {replay_endpoint or '-'}: {exc}") from exc

    def send(self, events: list[dict]) -> int:
        """Publish one batch; returns its sequence number."""
        payload = msgpack.packb([time.time(), events])
        seq, self.seq = self.seq, self.seq + 1
        self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self.buffer.append((seq, payload))
        return seq

    def serve_replay(self, timeout_ms: int) -> int:
        """Answer the replay requests that arrive within ``timeout_ms``; returns how many."""
        if self.replay is None:
            time.sleep(timeout_ms / 1000)
            return 0
        served = 0
        while self.replay.poll(timeout_ms if served == 0 else 0):
            frames = self.replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("events: ignored a malformed replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    self.replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            self.replay.send_multipart((client, b"", b"", END_SEQ, b""))
            served += 1
        return served

    def close(self) -> None:
        for sock in (self.pub, self.replay):
            if sock is not None:
                sock.close(linger=200)
        self.ctx.term()


def _attach(sock: zmq.Socket, endpoint: str) -> None:
    """Bind wildcard and ipc/inproc endpoints, connect to the rest (vLLM's rule)."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


class KvEvents:
    """The changes the block table reports, turned into batches of KV events on one thread."""

    def __init__(self, cfg: EventsConfig, table: BlockTable, changes: TierChanges, lock: AbstractContextManager[object],
                 data_dir: str | None) -> None:
        self.cfg, self.table, self.changes, self.lock = cfg, table, changes, lock
        self.stats = EventCounters()
        self.tokens = TokenStore(Path(data_dir) / "kv-events") if data_dir else None
        self.publisher = Publisher(cfg.endpoint, cfg.replay_endpoint, cfg.topic, cfg.buffer_steps)
        self._publish([{"type": "AllBlocksCleared"}], time.monotonic())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Publish from now on; drops token-store entries of blocks the disk no longer holds."""
        if self.tokens is not None:
            with self.lock:
                on_disk = {b.fk for b in self.table.records() if b.on_disk}
            dropped = self.tokens.keep_only(on_disk)
            if dropped:
                log.info("events: dropped %d token records of blocks no longer on disk", dropped)
        self._thread = threading.Thread(target=self._run, name="tierkv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.stats.replays += self.publisher.serve_replay(self.cfg.interval_ms)
            self.flush()

    def flush(self) -> None:
        """Publish the changes reported so far as one batch (publisher thread, or at close)."""
        with self.lock:
            batch = self.changes.take()
            if not batch:
                return
            rows = [(b.fk, tier, held, b.parent, b.tokens, self._ns(b.fk), t) for b, tier, held, t in batch]
        self._publish(self._events(rows), rows[0][6])

    def _ns(self, fk: bytes) -> dict | None:
        ns = self.table.namespaces.get(fk[:FINGERPRINT_BYTES])
        if ns is None:
            return None
        lo = ns.layout
        return {"model": ns.model, "tp_rank": ns.tp_rank, "tp_size": ns.tp_size, "dtype": lo.dtype,
                "block_size": lo.block_tokens, "fingerprint": fk[:FINGERPRINT_BYTES].hex()}

    def _events(self, rows: list[tuple]) -> list[dict]:
        """One event per change, consecutive removals of one medium in one event; writes the token
        store for changes of the disk tier."""
        out: list[dict] = []
        ops: list[tuple[bytes, tuple[bytes | None, bytes, dict] | None]] = []
        for fk, tier, held, parent, tokens, ns, _ in rows:
            medium = MEDIUM[tier]
            if not held:
                if tier == "disk":
                    ops.append((fk, None))
                last = out[-1] if out else None
                if last is not None and last["type"] == "BlockRemoved" and last["medium"] == medium:
                    last["block_hashes"].append(fk[FINGERPRINT_BYTES:])
                else:
                    out.append({"type": "BlockRemoved", "block_hashes": [fk[FINGERPRINT_BYTES:]], "medium": medium})
                continue
            known = self.tokens.get(fk) if self.tokens is not None and (tokens is None or ns is None) else None
            if known is not None:
                parent, tokens, ns = known
            elif tier == "disk" and ns is not None:
                ops.append((fk, (parent, tokens or b"", ns)))
            out.append(self._stored(fk, medium, parent, tokens, ns))
        if self.tokens is not None:
            self.tokens.write(ops)
        return out

    @staticmethod
    def _stored(fk: bytes, medium: str, parent: bytes | None, tokens: bytes | None, ns: dict | None) -> dict:
        ids = np.frombuffer(tokens, dtype="<i4").tolist() if tokens else []
        return {"type": "BlockStored", "block_hashes": [fk[FINGERPRINT_BYTES:]],
                "parent_block_hash": parent[FINGERPRINT_BYTES:] if parent else None, "token_ids": ids,
                "block_size": ns["block_size"] if ns else len(ids), "lora_id": None, "medium": medium,
                "lora_name": None, "locality": "REMOTE" if medium == "REMOTE" else "LOCAL",
                "ownership": "tierkv", "namespace": ns}

    def _publish(self, events: list[dict], since: float) -> None:
        if not events:
            return
        self.stats.seq = self.publisher.send(events)
        lag = (time.monotonic() - since) * 1000
        self.stats.events += len(events)
        self.stats.batches += 1
        self.stats.lag_ms_last, self.stats.lag_ms_max = lag, max(self.stats.lag_ms_max, lag)

    def close(self) -> None:
        """Publish what is left, then close the sockets and the token store."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.flush()
        self.publisher.close()
        if self.tokens is not None:
            self.tokens.close()


def open_events(cfg: EventsConfig, table: BlockTable, changes: TierChanges, lock: AbstractContextManager[object],
                data_dir: str | None) -> KvEvents | None:
    """The daemon's KV events when ``events.endpoint`` is set (taking the tier managers' ``changes``,
    the copies ``table``'s records hold already first), else None."""
    if not cfg.endpoint:
        return None
    events = KvEvents(cfg, table, changes, lock, data_dir)
    with lock:
        changes.start(table.records())
    return events

"""The two pieces every transfer the store starts shares: the moves it hands the transfer engine, and
the completion callback that settles each block's record under the store's lock."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from tierkv.cache.block import Block
from tierkv.core.keys import FINGERPRINT_BYTES
from tierkv.core.layout import Layout
from tierkv.movers.transfer import Job, Move


def moves(blocks: Sequence[Block], view: Callable[[int, int], Any], layout: Callable[[Block], Layout]) -> list[Move]:
    """One move per block: its LMDB key, its host slot and what identifies its bytes.

    Args:
        blocks: records with a host slot.
        view: the host pool's ``view(offset, nbytes)``.
        layout: the layout of a block's namespace.
    """
    out = []
    for b in blocks:
        assert b.host_off is not None
        out.append(Move(b.fk, view(b.host_off, b.nbytes), layout(b), b.fk[:FINGERPRINT_BYTES],
                        b.fk[FINGERPRINT_BYTES:]))
    return out


def job_moves(job: Job) -> list[Move]:
    """The per-block results of a disk or remote job."""
    return job.moves


def same(results: Any) -> Any:
    """The per-block results of a device copy (its list of copies)."""
    return results


def completion(lock: threading.Condition, blocks: Sequence[Block], each: Callable[[Block, Any], None], *,
               results: Callable[[Any], Sequence[Any]] = job_moves, locked: Callable[[Any], None] | None = None,
               after: Callable[[Any], None] | None = None) -> Callable[[Any], None]:
    """A transfer's completion callback: under the lock, ``each(block, result)`` for every block, then
    ``locked(job)``, then a wake-up of every waiter; ``after(job)`` runs once the lock is released.

    Args:
        lock: the store's condition (its lock and its waiters).
        blocks: the transfer's blocks, in the order of its results.
        each: settles one block's record from its result (a ``Move`` or a ``Copy``).
        results: the per-block results of what the engine passes the callback.
        locked: runs under the lock after every block is settled.
        after: runs outside the lock (deletes on disk, waking the evictor).
    """
    def done(job: Any) -> None:
        with lock:
            for b, r in zip(blocks, results(job)):
                each(b, r)
            if locked is not None:
                locked(job)
            lock.notify_all()
        if after is not None:
            after(job)

    return done


def settle(b: Block, attr: str = "loading") -> threading.Event | None:
    """Clear a block's load event (``loading`` or ``gpu_loading``); returns it, for the caller to set
    once the record is settled."""
    ev = getattr(b, attr)
    setattr(b, attr, None)
    return ev

"""Settle helpers shared by every transfer the store starts: the moves it hands the transfer engine, and
the completion callback that settles each block's record under the store's lock (through the managers
of the tiers involved)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from tierkv.cache.block import Block
from tierkv.core.keys import FINGERPRINT_BYTES
from tierkv.core.layout import Layout
from tierkv.movers.engine import Job, Move

R = TypeVar("R")  # what a transfer reports per block (a Move or a Copy)


def moves(blocks: Sequence[Block], view: Callable[[int, int], npt.NDArray[np.uint8]], layout: Callable[[Block], Layout]) -> list[Move]:
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


def completion(lock: threading.Condition, blocks: Sequence[Block], each: Callable[[Block, R], None], *,
               locked: Callable[[Job], None] | None = None,
               after: Callable[[Job], None] | None = None) -> Callable[[Job], None]:
    """A transfer's completion callback: under the lock, ``each(block, result)`` for every block, then
    ``locked(job)``, then a wake-up of every waiter; ``after(job)`` runs once the lock is released.

    Args:
        lock: the store's condition (its lock and its waiters).
        blocks: the transfer's blocks, in the order of the job's moves.
        each: settles one block's record from its result (a ``Move`` or a ``Copy``).
        locked: runs under the lock after every block is settled.
        after: runs outside the lock (deletes on disk, waking the evictor).
    """
    def done(job: Job) -> None:
        with lock:
            for b, r in zip(blocks, job.moves):
                each(b, r)
            if locked is not None:
                locked(job)
            lock.notify_all()
        if after is not None:
            after(job)

    return done


"""What the host and GPU store paths share: checks of a commit's request, the wait for its durable write
and its remote writes, and how a durable write's failure reads."""

from __future__ import annotations

import logging
import time

from tierkv.core.errors import BadRequest, TierFull, TierKVError
from tierkv.daemon.context import Context
from tierkv.movers.engine import Job

log = logging.getLogger("tierkv.table")


def check_alloc(n: object, keys: list[bytes] | None) -> None:
    """An alloc asks for ``n`` >= 0 slots, one per key when it names them.

    Raises:
        BadRequest: it does not.
    """
    if not isinstance(n, int) or n < 0:
        raise BadRequest("n must be a non-negative int")
    if keys is not None and len(keys) != n:
        raise BadRequest("keys and n disagree")


def check_commit(keys: list[bytes], offsets: list[int], durable: bool, disk_on: bool) -> None:
    """A commit names one slot per key, and asks for durability only with a disk tier.

    Raises:
        BadRequest: it does not.
    """
    if len(keys) != len(offsets):
        raise BadRequest("keys and slots differ in length")
    if durable and not disk_on:
        raise BadRequest("durable=True needs the disk tier, which is disabled")


def check_slots(offsets: list[int], owned: dict[int, int], what: str) -> None:
    """Every slot of a commit was allocated by this connection, and appears once.

    Raises:
        BadRequest: one was not, or one appears twice.
    """
    for off in offsets:
        if not isinstance(off, int) or off not in owned:
            raise BadRequest(f"{what} {off!r} was not allocated by this connection")
    if len(set(offsets)) != len(offsets):
        raise BadRequest("a slot appears twice")


def job_failed(job: Job) -> TierKVError | None:
    """The error of a durable write that did not reach disk in full, or None."""
    if job.error is not None or not all(m.ok for m in job.moves):
        return job.error or TierFull("durable write failed")
    return None


def finish(ctx: Context, job: Job | None, through: list[Job]) -> None:
    """Wait for a commit's disk write ``job`` and its remote writes ``through`` (those at most
    ``server.commit_wait_s``).

    Raises:
        TierKVError: the disk write failed (a failed remote write is logged and counted only: the block
            is a recompute, the commit stands).
    """
    if job is not None:
        job.wait()
    if through:
        deadline = time.monotonic() + ctx.cfg.server.commit_wait_s
        late = sum(not j.wait(max(0.0, deadline - time.monotonic())) for j in through)
        lost = sum(1 for j in through if j.done.is_set() for m in j.moves if not m.ok)
        if late or lost:
            log.warning("remote commit: %d blocks of its write-through jobs not written, %d jobs still running",
                        lost, late)
    err = job_failed(job) if job is not None else None
    if err is not None:
        raise err

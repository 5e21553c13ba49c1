"""What the transfers and the disk checks read of the store, as protocols: the store's wiring
(:class:`~tierkv.daemon.blockstore.BlockStore`) hands itself to them and satisfies both."""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from tierkv.cache.costmodel import CostModel
from tierkv.cache.counters import TierCounters
from tierkv.cache.placement import DiskPlacement, HostPlacement
from tierkv.cache.table import BlockTable
from tierkv.daemon.config import Config
from tierkv.movers.engine import TransferEngine
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.host import HostPool

if TYPE_CHECKING:
    from tierkv.tiers.remote import RemoteTier  # loads redis: the daemon imports it only with a remote tier


class Waker(Protocol):
    """The evictor, as a finished transfer sees it."""

    def wake(self) -> None:
        """Run soon (a transfer it may wait on finished)."""


class TransferParts(Protocol):
    """The tiers, records, placements and engine the transfers start jobs on and settle."""

    degraded: str  # set by a failed disk job

    @property
    def cfg(self) -> Config:
        ...

    @property
    def changed(self) -> threading.Condition:
        ...

    @property
    def host(self) -> HostPool:
        ...

    @property
    def disk(self) -> DiskTier | None:
        ...

    @property
    def remote(self) -> RemoteTier | None:
        ...

    @property
    def table(self) -> BlockTable:
        ...

    @property
    def hostp(self) -> HostPlacement:
        ...

    @property
    def diskp(self) -> DiskPlacement:
        ...

    @property
    def engine(self) -> TransferEngine:
        ...

    @property
    def cost(self) -> CostModel:
        ...

    @property
    def lock(self) -> AbstractContextManager[Any]:
        ...

    @property
    def remote_stats(self) -> TierCounters:
        ...

    @property
    def evictor(self) -> Waker:
        ...


class ScrubParts(Protocol):
    """The disk tier, its placement and the records the start-up scan and ``verify`` work on."""

    @property
    def lock(self) -> AbstractContextManager[Any]:
        ...

    @property
    def table(self) -> BlockTable:
        ...

    @property
    def diskp(self) -> DiskPlacement:
        ...

    @property
    def disk(self) -> DiskTier | None:
        ...

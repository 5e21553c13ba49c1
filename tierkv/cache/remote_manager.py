"""The remote tier's manager: which blocks this daemon knows the remote tier holds, and its figures.

The remote tier (Redis / Valkey) is shared by many daemons and evicts on its own: a block known to be
there may be gone when it is read (a miss), and one stored by another daemon is learned of only when a
lookup finds it. Plain code with no threads and no I/O; the daemon's store holds its lock around every
call. Only this manager writes a record's remote field, and it reports each copy gained or lost. A
daemon without a remote tier has a manager whose :attr:`~RemoteManager.present` is False.
"""

from __future__ import annotations

from collections.abc import Iterable

from tierkv.cache.block import Block
from tierkv.cache.counters import TierCounters
from tierkv.cache.tier_changes import TierChanges

__all__ = ["RemoteManager"]


class RemoteManager:
    """Blocks known to be in the remote tier, and the remote tier's counters.

    Args:
        changes: where copies gained and lost are reported.
        present: whether the daemon has a remote tier.
    """

    def __init__(self, changes: TierChanges, present: bool) -> None:
        self.changes, self.present = changes, present
        self.stats = TierCounters()

    def prepare_store(self, blocks: Iterable[Block]) -> None:
        """Writes of ``blocks`` to the remote tier start: each counts as there (a lookup through this
        daemon finds it) until :meth:`complete_store` says the write failed."""
        for b in blocks:
            b.on_remote = True
            self.changes.gained(b, "remote")

    def complete_store(self, b: Block, ok: bool) -> None:
        """The write of ``b`` ended: its bytes are counted, or a failed write takes it back."""
        if ok:
            self.stats.stored(b.nbytes)
        elif b.on_remote:
            b.on_remote = False
            self.changes.lost(b, "remote")

    def deleted(self, b: Block) -> None:
        """``b``'s copy was deleted from the remote tier."""
        if b.on_remote:
            b.on_remote = False
            self.changes.lost(b, "remote")

    def found(self, b: Block) -> None:
        """A fetch found ``b`` in the remote tier (a new record, loading from there)."""
        if not b.on_remote:
            b.on_remote = True
            self.changes.gained(b, "remote")

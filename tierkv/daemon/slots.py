"""The slot allocator: host and GPU slots for new blocks, making room by policy. When no block can make
room now, a request waits on the store's condition (woken when blocks become clean, free or drained)
for at most ``server.slot_wait_s`` seconds, or the time it asks for."""

from __future__ import annotations

import time
from collections.abc import Callable

from tierkv.cache.block import Session
from tierkv.cache.gpu_manager import GpuManager
from tierkv.cache.host_manager import HostManager
from tierkv.core.errors import BadRequest, TierFull
from tierkv.daemon.context import Context


class Slots:
    """Hands out host slots (and GPU slots when the GPU tier is on). Called with the lock held."""

    def __init__(self, ctx: Context, hostm: HostManager, gpum: GpuManager) -> None:
        self.ctx = ctx
        self.hostm = hostm
        self.gpum = gpum
        self.kick = ctx.kick  # the evictor runs soon (``force``: demote even below the high watermark)

    def host(self, slot: int, wait: bool = True, timeout: float | None = None, drop_dirty: bool = True) -> int:
        """A host slot, evicting clean blocks first. With ``timeout`` 0 a request never waits: blocks
        not yet written to disk are dropped unwritten to make room. Otherwise it waits (with ``wait``)
        up to ``timeout`` seconds (None: ``server.slot_wait_s``) for the writer to clean blocks, then
        drops unwritten ones. ``drop_dirty`` False: only clean blocks ever make room (a prefetch must
        not cost a block its disk copy).

        Raises:
            TierFull: every block is leased, moving or pinned (after the wait), or the daemon is closing.
        """
        hp, ctx = self.hostm, self.ctx
        deadline = None
        while True:
            off = hp.alloc_free(slot)
            if off is not None:
                if hp.above_high():
                    self.kick(False)
                    if ctx.synchronous:  # one trace, one result: the demotion ends before the store goes on
                        ctx.wait_for_pass(time.monotonic() + ctx.cfg.server.slot_wait_s)
                return off
            if ctx.closing:
                raise TierFull("daemon is shutting down")
            if hp.evict_for(slot):
                ctx.notify()
                continue
            now = time.monotonic()
            if deadline is None:
                deadline = now + (ctx.cfg.server.slot_wait_s if timeout is None else max(0.0, timeout))
            if drop_dirty and now >= deadline and hp.drop_unwritten(slot):
                ctx.notify()
                self.kick(False)
                continue
            if not wait or now >= deadline or not hp.evictable_exists():
                raise TierFull("host tier is full: every block is leased, moving or pinned")
            self.kick(True)
            if ctx.synchronous:  # the demotion's victims are settled before this store picks any slot
                ctx.wait_for_pass(deadline)
            else:
                ctx.wait_until(deadline)

    def gpu(self, slot: int, wait: bool = True) -> int:
        """A device slot, dropping clean device copies (or, with ``wait``, waiting up to
        ``server.slot_wait_s`` for drains to finish).

        Raises:
            TierFull: no device slot can be freed (after the wait), or the daemon is closing.
        """
        gp, ctx = self.gpum, self.ctx
        deadline = None
        while True:
            off = gp.alloc(slot)
            if off is not None:
                return off
            if not wait or ctx.closing:
                raise TierFull("GPU tier has no evictable block right now")
            if deadline is None:
                deadline = time.monotonic() + ctx.cfg.server.slot_wait_s
            if time.monotonic() > deadline or not gp.draining():
                raise TierFull("GPU tier is full: every block is leased or being filled")
            ctx.wait_until(deadline)

    def take(self, s: Session, keys: list[bytes] | None, n: int, slot: int, take: Callable[[], int],
             owned: dict[int, int], free: Callable[[int], None]) -> list[int | None]:
        """Slots from ``take`` for the ``n`` new blocks not cached yet (None for cached ``keys``), recorded
        in the connection's ``owned``; all given back (``free``) if the tier fills on the way.

        Raises:
            TierFull: the tier filled.
        """
        table = self.hostm.table
        out: list[int | None] = []
        try:
            for i in range(n):
                if keys is not None and (s.fp + keys[i]) in table:
                    out.append(None)
                    continue
                off = take()
                owned[off] = slot
                out.append(off)
        except TierFull:
            for given in out:
                if given is not None:
                    owned.pop(given, None)
                    free(given)
            raise
        return out

    def tier(self, tier: object) -> str:
        """Check a tier name from the wire: "host", or "gpu" when the GPU tier is on.

        Raises:
            BadRequest: another name, or "gpu" with the GPU tier off.
        """
        if tier == "host":
            return "host"
        if tier == "gpu":
            if not self.gpum.present:
                raise BadRequest("the GPU tier is off (start the daemon with --gpu-capacity)")
            return "gpu"
        raise BadRequest(f"tier must be 'host' or 'gpu', got {tier!r}")

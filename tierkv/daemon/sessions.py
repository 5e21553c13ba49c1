"""Connections as the store sees them: binding one to its namespace, ending its leases, and giving
back everything it held when it closes (however the client died)."""

from __future__ import annotations

from collections.abc import Iterable

from tierkv.cache.block import Session
from tierkv.cache.managers import TierManagers
from tierkv.core.errors import BadRequest
from tierkv.core.keys import Namespace
from tierkv.daemon.context import Context
from tierkv.tiers.host import HostPool, SlabAllocator, slot_size_for


def namespace(s: Session) -> Namespace:
    """The connection's namespace; BadRequest before HELLO."""
    if s.ns is None:
        raise BadRequest("no namespace on this connection: send HELLO first")
    return s.ns


class Sessions:
    """Registers connections and releases what they hold."""

    def __init__(self, ctx: Context, m: TierManagers, host: HostPool, gpu: SlabAllocator | None) -> None:
        self.ctx = ctx
        self.m = m
        self.table = m.table
        self.host = host
        self.gpu = gpu

    def register(self, s: Session, ns: Namespace) -> None:
        """Bind a connection to its namespace (once: its slots and leases are sized for it)."""
        slot = slot_size_for(ns.layout.block_bytes)
        if slot > self.host.slab_bytes:
            raise BadRequest(f"a block of {ns.layout.block_bytes} bytes exceeds the host slab size "
                             f"({self.host.slab_bytes}); raise host.slab_bytes")
        with self.ctx.lock:
            self.table.bind(s, ns)

    def release(self, s: Session, lease_ids: Iterable[int]) -> None:
        """End leases; unknown ids (double release, another client's lease) are an error."""
        with self.ctx.lock:
            self.m.end_leases(self.table.release(s, lease_ids))
            self.ctx.notify()

    def close(self, s: Session) -> None:
        """Release everything a connection held (it may have died without a word)."""
        with self.ctx.lock:
            self.m.end_leases(self.table.drop_leases(s))
            for off in s.slots:
                self.host.free(off)
            s.slots.clear()
            for off in s.gpu_slots:
                assert self.gpu is not None  # the connection holds GPU slots: the GPU tier is on
                self.gpu.free(off)
            s.gpu_slots.clear()
            self.table.unbind(s)
            self.ctx.notify()

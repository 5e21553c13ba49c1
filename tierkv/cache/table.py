"""Block table: the record of every block a local tier holds, its namespaces, and the leases on it.

Plain code with no threads and no I/O: the daemon's store (:mod:`tierkv.daemon.blockstore`) holds its
lock around every call. Records are keyed by ``fingerprint + key``; when the shared lookup index is
built, every key is mirrored into it so clients answer lookups without a round trip.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from tierkv.cache.block import Block, Lease, Session, tier_of, validate_keys
from tierkv.core.errors import BadRequest
from tierkv.core.keys import FINGERPRINT_BYTES, Namespace
from tierkv.core.layout import Layout
from tierkv.core.lookup_index import IndexedBlocks, LookupIndex
from tierkv.core.lookup_index import available as lookup_index_available

__all__ = ["Block", "BlockTable", "Lease", "Session", "validate_keys"]


class BlockTable:
    """Block records by ``fingerprint + key``, the namespaces they belong to, and lease bookkeeping."""

    def __init__(self, index_slots: int = 0) -> None:
        """Args:
            index_slots: slots of the shared lookup index (rounded up to a power of two); 0: none.
        """
        self.index: LookupIndex | None = None
        self.blocks: dict[bytes, Block] = {}
        if index_slots and lookup_index_available():
            self.index = LookupIndex(1 << (index_slots - 1).bit_length())
            self.blocks = IndexedBlocks(self.index)
        self.namespaces: dict[bytes, Namespace] = {}
        self.ns_blocks: dict[bytes, int] = {}
        self.ns_hits: dict[bytes, list[int]] = {}  # fingerprint -> [blocks fetches got, blocks they missed]
        self._ns_sessions: dict[bytes, int] = {}  # connections bound to each namespace
        self._lease_ids = 0

    # ---- records ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, fk: bytes) -> bool:
        return fk in self.blocks

    def get(self, fk: bytes) -> Block | None:
        """The record of ``fk``, or None."""
        return self.blocks.get(fk)

    def records(self) -> Iterator[Block]:
        """Every record (the caller holds the store's lock while it iterates)."""
        return iter(self.blocks.values())

    def add(self, b: Block) -> Block:
        """Record a new block (it holds no copy yet: the tier managers give it one) and count it in its
        namespace."""
        replaced = b.fk in self.blocks
        self.blocks[b.fk] = b
        if not replaced:
            fp = b.fk[:FINGERPRINT_BYTES]
            self.ns_blocks[fp] = self.ns_blocks.get(fp, 0) + 1
        return b

    def remove(self, b: Block) -> None:
        """Drop the record of a block no tier holds any more (a replaced record stays)."""
        if self.blocks.get(b.fk) is b:
            del self.blocks[b.fk]
            fp = b.fk[:FINGERPRINT_BYTES]
            self.ns_blocks[fp] = self.ns_blocks.get(fp, 1) - 1

    def layout_of(self, b: Block) -> Layout:
        """The layout of a block's namespace (registered by the connection that stored it)."""
        ns = self.namespaces.get(b.fk[:FINGERPRINT_BYTES])
        assert ns is not None, "a host block always belongs to a registered namespace"
        return ns.layout

    # ---- prefix lookup ----------------------------------------------------------------------------
    def prefix(self, fp: bytes, keys: Iterable[bytes]) -> list[Block]:
        """Records of the leading cached blocks of ``keys``; stops at the first miss."""
        out: list[Block] = []
        get = self.blocks.get
        for k in keys:
            b = get(fp + k)
            if b is None:
                break
            out.append(b)
        return out

    def lookup(self, fp: bytes, keys: list[bytes]) -> list[str]:
        """Tier of each leading cached block; stops at the first miss."""
        return [tier_of(b) for b in self.prefix(fp, keys)]

    def lookup_count(self, fp: bytes, keys: list[bytes]) -> int:
        """How many leading keys are cached, in one C-level walk (the scheduler's hot path)."""
        found = list(map(self.blocks.get, [fp + k for k in keys]))
        try:
            return found.index(None)  # Block compares by identity: a C-level scan
        except ValueError:
            return len(found)

    # ---- namespaces -------------------------------------------------------------------------------
    def bind(self, s: Session, ns: Namespace) -> None:
        """Bind a connection to its namespace (once: its slots and leases are sized for it)."""
        if s.ns is not None:
            if s.ns != ns:
                raise BadRequest("this connection is bound to another namespace; open a new connection")
            return
        s.ns, s.fp = ns, ns.fingerprint
        self.namespaces.setdefault(s.fp, ns)
        self._ns_sessions[s.fp] = self._ns_sessions.get(s.fp, 0) + 1

    def unbind(self, s: Session) -> None:
        """Unbind a closing connection; a namespace nobody uses and holding no block is forgotten
        (HELLOs must not grow memory)."""
        if s.ns is None:
            return
        fp = s.fp
        self._ns_sessions[fp] -= 1
        if self._ns_sessions[fp] == 0 and self.ns_blocks.get(fp, 0) <= 0:
            del self._ns_sessions[fp]
            self.namespaces.pop(fp, None)
            self.ns_blocks.pop(fp, None)
            self.ns_hits.pop(fp, None)
        s.ns = None

    def count_fetch(self, fp: bytes, asked: int, got: int) -> None:
        """Count a fetch's hits and misses against its namespace."""
        c = self.ns_hits.setdefault(fp, [0, 0])
        c[0] += got
        c[1] += asked - got

    # ---- tickets and leases -----------------------------------------------------------------------
    def open_ticket(self, s: Session, leased: list[Block], tiers: list[str], tier: str) -> int:
        """Record a fetch's leased blocks on the connection until it waits; returns the ticket."""
        self._lease_ids += 1
        s.tickets[self._lease_ids] = (leased, tiers, tier)
        return self._lease_ids

    def take_ticket(self, s: Session, ticket: object) -> tuple[list[Block], list[str], str]:
        """The blocks, source tiers and lease tier of a pending fetch, which ends here."""
        if ticket not in s.tickets:
            raise BadRequest(f"ticket {ticket!r} is not pending on this connection")
        return s.tickets.pop(ticket)

    def hold(self, s: Session, lease_id: int, blocks: list[Block], tier: str) -> Lease:
        """Turn a ticket's blocks into a lease the connection holds until it releases it."""
        lease = Lease(lease_id, blocks, tier)
        s.leases[lease.id] = lease
        return lease

    def release(self, s: Session, lease_ids: Iterable[int]) -> list[Lease]:
        """End leases; unknown ids (double release, another client's lease) are an error. Returns the
        leases ended (the tier managers end their blocks' leases:
        :meth:`~tierkv.cache.managers.TierManagers.end_leases`)."""
        ids = list(lease_ids)
        if len(set(ids)) != len(ids):
            raise BadRequest("a lease id appears twice")
        for lid in ids:
            if lid not in s.leases:
                raise BadRequest(f"lease {lid!r} is not held by this connection")
        return [s.leases.pop(lid) for lid in ids]

    def drop_leases(self, s: Session) -> list[Lease]:
        """End every lease and pending ticket of a closing connection; returns them (as for :meth:`release`)."""
        out = list(s.leases.values()) + [Lease(0, leased, tier) for leased, _tiers, tier in s.tickets.values()]
        s.leases.clear()
        s.tickets.clear()
        return out

    def close(self) -> None:
        """Unmap the shared lookup index."""
        if self.index is not None:
            self.index.close()


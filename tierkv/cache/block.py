"""Block records, leases and per-connection state: the plain data the block table holds.

A block is immutable and content-addressed by ``fingerprint + key``. It may have a slot in the GPU
tier, a slot in the host tier, a value on disk, a copy in the remote tier, or several of these. The
flags below say which copies are in use; a copy in use never moves or vanishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tierkv.core.errors import BadRequest
from tierkv.core.keys import MAX_KEY_BYTES, Namespace

if TYPE_CHECKING:
    from threading import Event


@dataclass(slots=True, eq=False)
class Block:
    """One block's record."""

    fk: bytes                      # fingerprint + key
    nbytes: int                    # raw bytes (the namespace's block size)
    host_off: int | None = None    # slot offset in the host pool
    on_disk: bool = False
    disk_bytes: int = 0            # encoded bytes on disk
    leases: int = 0
    writing: int = 0               # host -> disk/remote stores in flight (they read the slot)
    on_remote: bool = False        # known to be in the remote tier
    loading: Event | None = None   # set when a load into the host slot finishes (the daemon makes it)
    load_failed: bool = False
    hits: int = 0
    pin: int = 0                   # retention priority of a pinned prefix (0 = not pinned)
    mass: float = 1.0              # last attention mass a client reported (1.0 = uniform)
    gpu_off: int | None = None     # slot offset in the GPU tier's device pool
    gpu_leases: int = 0
    gpu_loading: Event | None = None  # set when a host -> gpu copy finishes
    draining: bool = False         # committed on the GPU, its host copy not made yet (the only copy)
    parent: bytes | None = None    # the previous block of the chain it was stored in (tails go first)

    @property
    def protected(self) -> bool:
        """The host slot must stay (read by a client or a transfer, or pinned)."""
        return self.leases > 0 or self.writing or self.loading is not None or self.pin > 0

    @property
    def gpu_protected(self) -> bool:
        """The GPU slot must stay (read by a client, being filled, or the only copy)."""
        return self.gpu_leases > 0 or self.gpu_loading is not None or self.draining

    @property
    def busy(self) -> bool:
        """Any tier's copy is in use: a delete must skip the block."""
        return self.protected or self.gpu_protected

    @property
    def host_ready(self) -> bool:
        """The host slot holds the block's bytes (it is not being filled)."""
        return self.host_off is not None and self.loading is None

    @property
    def gpu_ready(self) -> bool:
        """The GPU slot holds the block's bytes (it is not being filled)."""
        return self.gpu_off is not None and self.gpu_loading is None


@dataclass
class Lease:
    """Blocks pinned in one tier for one connection."""

    id: int
    blocks: list[Block]
    tier: str = "host"             # which slot the lease pins: "host" or "gpu"


@dataclass
class Session:
    """Per-connection state: its namespace, unclaimed slots and leases (all freed when it closes)."""

    id: int
    rid: int = 0                   # request id being served (replies echo it)
    ns: Namespace | None = None
    fp: bytes = b""
    slots: dict[int, int] = field(default_factory=dict)   # offset -> slot size, allocated but not committed
    gpu_slots: dict[int, int] = field(default_factory=dict)  # the same for the GPU tier
    leases: dict[int, Lease] = field(default_factory=dict)
    # fetches not yet waited: blocks, their source tiers, and the tier they are leased in
    tickets: dict[int, tuple[list[Block], list[str], str]] = field(default_factory=dict)
    # durable writes committed with wait=False, not yet waited for by SYNC (transfer jobs)
    pending: list[Any] = field(default_factory=list)


def validate_keys(keys: object, limit: int = 1 << 16) -> list[bytes]:
    """Check a key list from the wire.

    Args:
        keys: the request's ``keys`` field.
        limit: the most keys one request may carry.

    Returns:
        ``keys``, unchanged.

    Raises:
        BadRequest: not a list of 1..MAX_KEY_BYTES byte strings, or too many.
    """
    if not isinstance(keys, list):
        raise BadRequest("keys must be a list of bytes")
    if len(keys) > limit:
        raise BadRequest(f"too many keys in one request ({len(keys)} > {limit})")
    for k in keys:  # a plain loop: about half the cost of all(<generator>) on a hot path (lookup)
        if type(k) is not bytes or not 0 < len(k) <= MAX_KEY_BYTES:
            raise BadRequest(f"each key must be 1..{MAX_KEY_BYTES} bytes")
    return keys


def validate_chains(chains: object, n: int) -> dict[int, bytes | None]:
    """Check a commit's ``chains`` field: where chains of its ``n`` keys start, each a pair of an
    increasing index and the key that chain continues (or nil). Missing: one chain with no parent.

    Raises:
        BadRequest: not a list of such pairs.
    """
    if chains is None:
        return {0: None}
    if not isinstance(chains, list) or len(chains) > n:
        raise BadRequest("chains must be a list of [index, parent] pairs, at most one a key")
    out: dict[int, bytes | None] = {}
    last = -1
    for pair in chains:
        if not isinstance(pair, list) or len(pair) != 2 or type(pair[0]) is not int or not last < pair[0] < n:
            raise BadRequest(f"chains must be [index, parent] pairs with increasing indexes below {n}")
        parent = pair[1]
        if parent is not None and (type(parent) is not bytes or not 0 < len(parent) <= MAX_KEY_BYTES):
            raise BadRequest(f"a chain's parent must be nil or a key of 1..{MAX_KEY_BYTES} bytes")
        out[pair[0]] = parent
        last = pair[0]
    return out


def tier_of(b: Block) -> str:
    """The fastest tier holding a ready copy of ``b`` (a block being filled counts as its source)."""
    if b.gpu_off is not None and b.gpu_loading is None:
        return "gpu"
    return "host" if b.host_off is not None else "disk"


def fetch_source(b: Block) -> str:
    """The tier a host lease on ``b`` is served from: its host slot, or what is filling that slot."""
    if b.loading is None:
        return "host"
    return "gpu" if b.draining else "disk"

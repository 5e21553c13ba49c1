"""Block records, leases and per-connection state: the plain data the block table holds.

A block is immutable and content-addressed by ``fingerprint + key``. It may have a slot in the GPU
tier, a slot in the host tier, a value on disk, a copy in the remote tier, or several of these; each
tier's manager (:mod:`tierkv.cache.host_manager`, ``gpu_manager``, ``disk_manager``, ``remote_manager``)
owns that tier's fields of the record and reports every copy gained or lost
(:class:`~tierkv.cache.tier_changes.TierChanges`). A copy in use never moves or vanishes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tierkv.core.errors import BadRequest
from tierkv.core.keys import MAX_KEY_BYTES, Namespace

if TYPE_CHECKING:
    from tierkv.movers.engine import Job


class LoadSignal(Protocol):
    """A load in flight, as the daemon signals its end (a ``threading.Event``): the record only holds it,
    and the paths that wait for the load wait on it."""

    def set(self) -> None:
        """The load finished (or failed: ``Block.load_failed`` says which)."""

    def is_set(self) -> bool:
        """Whether the load finished."""

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the load finishes or ``timeout`` seconds pass; whether it finished."""


# The fields of a record each tier manager owns: only it writes them (tests/project/test_layering.py
# checks), so a block's life in a tier is the manager's transitions and nothing else.
TIER_FIELDS: dict[str, tuple[str, ...]] = {
    "host": ("host_off", "leases", "writing", "loading", "load_failed", "pin", "pins"),
    "gpu": ("gpu_off", "gpu_leases", "gpu_loading", "draining"),
    "disk": ("on_disk", "disk_bytes", "disk_pins"),
    "remote": ("on_remote",),
}


class Block:
    """One block's record: what it is (``fk``, size, the chain it was stored in, its token ids, the
    tenant that stored it), the
    signals the policies read (``hits``, ``mass``), and per tier the state its manager owns
    (:data:`TIER_FIELDS`). A new record holds no copy: the managers give it one.
    """

    __slots__ = ("fk", "nbytes", "parent", "tokens", "tenant", "hits", "mass",
                 "host_off", "leases", "writing", "loading", "load_failed", "pin", "pins",
                 "gpu_off", "gpu_leases", "gpu_loading", "draining", "on_disk", "disk_bytes", "disk_pins", "on_remote")

    def __init__(self, fk: bytes, nbytes: int, parent: bytes | None = None, tokens: bytes | None = None,
                 tenant: str | None = None) -> None:
        self.fk = fk                      # fingerprint + key
        self.nbytes = nbytes              # raw bytes (the namespace's block size)
        self.parent = parent              # the previous block of the chain it was stored in (tails go first)
        self.tokens = tokens              # the block's token ids (int32), when the store was told them
        self.tenant = tenant              # the tenant that stored it (its quotas count it), when told
        self.hits = 0                     # uses since it was cached (leases, stores that found it)
        self.mass = 1.0                   # last attention mass a client reported (1.0 = uniform)
        # host: its slot, leases on the slot, host -> disk/remote stores in flight (they read the slot),
        # a load filling the slot (set when it finishes; the daemon makes it), whether it failed, the
        # retention priority of a pinned prefix (0 = not pinned) and how many pins hold it there
        self.host_off: int | None = None
        self.leases = 0
        self.writing = 0
        self.loading: LoadSignal | None = None
        self.load_failed = False
        self.pin = 0
        self.pins = 0
        # gpu: its device slot, leases on it, a host -> gpu copy filling it, and whether it is the only
        # copy (committed on the GPU, its host copy not made yet)
        self.gpu_off: int | None = None
        self.gpu_leases = 0
        self.gpu_loading: LoadSignal | None = None
        self.draining = False
        # disk: a value on disk, its encoded bytes and how many pins keep it there; remote: known to be
        # in the remote tier
        self.on_disk = False
        self.disk_bytes = 0
        self.disk_pins = 0
        self.on_remote = False

    def __repr__(self) -> str:
        return (f"Block({self.fk.hex()[:16]}, gpu={self.gpu_off}, host={self.host_off}, disk={self.on_disk}, "
                f"remote={self.on_remote}, leases={self.leases})")

    def held(self) -> list[str]:
        """The tiers holding a copy: ``gpu``, ``host``, ``disk``, ``remote``."""
        return [t for t, on in (("gpu", self.gpu_off is not None), ("host", self.host_off is not None),
                                ("disk", self.on_disk), ("remote", self.on_remote)) if on]

    @property
    def protected(self) -> bool:
        """The host slot must stay (read by a client or a transfer, or pinned)."""
        return self.leases > 0 or self.writing > 0 or self.loading is not None or self.pin > 0

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
    pending: list[Job] = field(default_factory=list)


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


def _index_pairs(value: object, n: int, field: str, item: str) -> list[tuple[int, object]]:
    """``value`` as ``[index, item]`` pairs with increasing indexes below ``n``, at most one per key.

    Raises:
        BadRequest: it is not.
    """
    if not isinstance(value, list) or len(value) > n:
        raise BadRequest(f"{field} must be a list of [index, {item}] pairs, at most one a key")
    last = -1
    for pair in value:
        if not isinstance(pair, list) or len(pair) != 2 or type(pair[0]) is not int or not last < pair[0] < n:
            raise BadRequest(f"{field} must be [index, {item}] pairs with increasing indexes below {n}")
        last = pair[0]
    return [(i, v) for i, v in value]


def validate_chains(chains: object, n: int) -> dict[int, bytes | None]:
    """Check a commit's ``chains`` field: where chains of its ``n`` keys start, each a pair of an
    increasing index and the key that chain continues (or nil). Missing: one chain with no parent.

    Raises:
        BadRequest: not a list of such pairs.
    """
    if chains is None:
        return {0: None}
    out: dict[int, bytes | None] = {}
    for i, parent in _index_pairs(chains, n, "chains", "parent"):
        if parent is not None and (type(parent) is not bytes or not 0 < len(parent) <= MAX_KEY_BYTES):
            raise BadRequest(f"a chain's parent must be nil or a key of 1..{MAX_KEY_BYTES} bytes")
        out[i] = parent
    return out


MAX_TENANT = 256  # characters of a tenant's name


def validate_tenants(tenants: object, n: int) -> dict[int, str | None]:
    """Check a commit's ``tenants`` field: where the runs of its ``n`` keys stored for one tenant start,
    pairs of an increasing index and the tenant (or nil: none). Missing: no tenant.

    Raises:
        BadRequest: not a list of such pairs.
    """
    if tenants is None:
        return {}
    out: dict[int, str | None] = {}
    for i, t in _index_pairs(tenants, n, "tenants", "tenant"):
        if t is not None and (not isinstance(t, str) or not 0 < len(t) <= MAX_TENANT):
            raise BadRequest(f"a tenant must be nil or a name of 1..{MAX_TENANT} characters")
        out[i] = None if t is None else sys.intern(t)  # one string per tenant, however many blocks
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


def validate_tokens(tokens: object, n: int, block_tokens: int) -> list[bytes] | None:
    """Check a commit's ``tokens`` field: the token ids of its ``n`` blocks, ``block_tokens`` each, as
    one int32 little-endian byte string. Returns them split per block (None when absent).

    Raises:
        BadRequest: not bytes of exactly that length.
    """
    if tokens is None:
        return None
    size = block_tokens * 4
    if type(tokens) is not bytes or len(tokens) != n * size:
        got = len(tokens) if isinstance(tokens, bytes) else type(tokens).__name__
        raise BadRequest(f"tokens must be {n} blocks x {block_tokens} int32 token ids ({n * size} bytes), got {got}")
    return [tokens[i * size:(i + 1) * size] for i in range(n)]

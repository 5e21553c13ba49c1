"""Block records, leases and per-connection state: the plain data the block table holds.

A block is immutable and content-addressed by ``fingerprint + key``. It may have a slot in the GPU
tier, a slot in the host tier, a value on disk, a copy in the remote tier, or several of these. The
flags below say which copies are in use; a copy in use never moves or vanishes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tierkv.core.errors import BadRequest
from tierkv.core.keys import MAX_KEY_BYTES, Namespace


class LoadSignal(Protocol):
    """A load in flight, as the daemon signals its end (a ``threading.Event``): the record only holds it,
    and the paths that wait for the load wait on it."""

    def set(self) -> None:
        """The load finished (or failed: ``Block.load_failed`` says which)."""

    def is_set(self) -> bool:
        """Whether the load finished."""

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the load finishes or ``timeout`` seconds pass; whether it finished."""


#: ``observer(block, tier, held)``: a block came to be held in ``tier`` (``held``) or left it.
Observer = Callable[["Block", str, bool], None]


class Block:
    """One block's record.

    The four tier copies (``gpu_off``, ``host_off``, ``on_disk``, ``on_remote``) are properties: a
    record in a table that has an observer reports each copy it gains or loses (KV events).
    """

    __slots__ = ("fk", "nbytes", "_host", "_disk", "disk_bytes", "leases", "writing", "_remote", "loading",
                 "load_failed", "hits", "pin", "mass", "_gpu", "gpu_leases", "gpu_loading", "draining",
                 "parent", "tokens", "obs")

    def __init__(self, fk: bytes, nbytes: int, host_off: int | None = None, on_disk: bool = False,
                 disk_bytes: int = 0, leases: int = 0, writing: int = 0, on_remote: bool = False,
                 loading: LoadSignal | None = None, load_failed: bool = False, hits: int = 0, pin: int = 0,
                 mass: float = 1.0, gpu_off: int | None = None, gpu_leases: int = 0,
                 gpu_loading: LoadSignal | None = None, draining: bool = False, parent: bytes | None = None,
                 tokens: bytes | None = None) -> None:
        self.fk = fk                      # fingerprint + key
        self.nbytes = nbytes              # raw bytes (the namespace's block size)
        self._host = host_off             # slot offset in the host pool
        self._disk = on_disk
        self.disk_bytes = disk_bytes      # encoded bytes on disk
        self.leases = leases
        self.writing = writing            # host -> disk/remote stores in flight (they read the slot)
        self._remote = on_remote          # known to be in the remote tier
        self.loading = loading            # set when a load into the host slot finishes (the daemon makes it)
        self.load_failed = load_failed
        self.hits = hits
        self.pin = pin                    # retention priority of a pinned prefix (0 = not pinned)
        self.mass = mass                  # last attention mass a client reported (1.0 = uniform)
        self._gpu = gpu_off               # slot offset in the GPU tier's device pool
        self.gpu_leases = gpu_leases
        self.gpu_loading = gpu_loading    # set when a host -> gpu copy finishes
        self.draining = draining          # committed on the GPU, its host copy not made yet (the only copy)
        self.parent = parent              # the previous block of the chain it was stored in (tails go first)
        self.tokens = tokens              # the block's token ids (int32), when the store was told them
        self.obs: Observer | None = None  # set while the record is in a table that reports changes

    def __repr__(self) -> str:
        return (f"Block({self.fk.hex()[:16]}, gpu={self._gpu}, host={self._host}, disk={self._disk}, "
                f"remote={self._remote}, leases={self.leases})")

    def held(self) -> list[str]:
        """The tiers holding a copy: ``gpu``, ``host``, ``disk``, ``remote``."""
        return [t for t, on in (("gpu", self._gpu is not None), ("host", self._host is not None),
                                ("disk", self._disk), ("remote", self._remote)) if on]

    @property
    def host_off(self) -> int | None:
        return self._host

    @host_off.setter
    def host_off(self, off: int | None) -> None:
        if self.obs is not None and (off is None) != (self._host is None):
            self.obs(self, "host", off is not None)
        self._host = off

    @property
    def gpu_off(self) -> int | None:
        return self._gpu

    @gpu_off.setter
    def gpu_off(self, off: int | None) -> None:
        if self.obs is not None and (off is None) != (self._gpu is None):
            self.obs(self, "gpu", off is not None)
        self._gpu = off

    @property
    def on_disk(self) -> bool:
        return self._disk

    @on_disk.setter
    def on_disk(self, on: bool) -> None:
        if self.obs is not None and on != self._disk:
            self.obs(self, "disk", on)
        self._disk = on

    @property
    def on_remote(self) -> bool:
        return self._remote

    @on_remote.setter
    def on_remote(self, on: bool) -> None:
        if self.obs is not None and on != self._remote:
            self.obs(self, "remote", on)
        self._remote = on

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

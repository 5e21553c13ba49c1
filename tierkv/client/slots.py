"""Slots and leases: a client's views into pool memory between two control calls.

:class:`Slots` are allocated for new blocks and written in place before a commit; a :class:`Lease`
pins cached blocks for reading in place until it is released.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from tierkv.core.protocol import Op

if TYPE_CHECKING:
    from tierkv.client.client import Client


class Slots:
    """Slots allocated for new blocks (host, or GPU with ``tier="gpu"``): write ``views[i]`` in place,
    then :meth:`commit`.

    Slots that are never committed are given back by :meth:`abort`, on leaving a ``with`` block, or
    when the connection closes.
    """

    def __init__(self, client: Client, offsets: list[int], tier: str = "host") -> None:
        self._client = client
        self.offsets = offsets
        self.tier = tier
        self.views: list[torch.Tensor] = [client._view(off, tier) for off in offsets]
        self._open = True

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.views[i]

    def commit(self, keys: Sequence[bytes], durable: bool = False,
               chains: Sequence[tuple[int, bytes | None]] | None = None, remote: bool = False,
               tokens: Any = None, uses: Sequence[bytes] = (), tenants: Any = None) -> int:
        """Publish the slots under ``keys``; returns how many were new. ``remote=True`` returns once
        they are written through to the remote tier; ``uses`` are cached blocks skipped rather than
        written again. See :meth:`Client.commit`."""
        return self._client.commit(keys, self, durable=durable, chains=chains, remote=remote, tokens=tokens,
                                   tenants=tenants,
                                   uses=uses)

    def abort(self) -> None:
        """Give the slots back without publishing them."""
        if self._open and self.offsets:
            self._open = False
            self._client._call(Op.ABORT, {"slots": self.offsets, "tier": self.tier})
        self._open = False

    def __enter__(self) -> Slots:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._open:
            self.abort()


class Lease:
    """Blocks pinned in host (or GPU) memory for reading in place; release it (or leave the ``with``
    block). ``tiers[i]`` says where block ``i`` came from; ``tier`` which memory the views are in."""

    def __init__(self, client: Client, lease_id: int, offsets: list[int], tiers: list[str],
                 tier: str = "host") -> None:
        self._client = client
        self.id = lease_id
        self.offsets = offsets
        self.tiers = tiers
        self.tier = tier
        self.views: list[torch.Tensor] = [client._view(off, tier) for off in offsets]
        self._held = True

    @property
    def count(self) -> int:
        """How many leading blocks are available."""
        return len(self.offsets)

    def release(self) -> None:
        """End the lease; the views must not be used afterwards."""
        if self._held:
            self._held = False
            self.views = []
            self._client._call(Op.RELEASE, {"leases": [self.id]})

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

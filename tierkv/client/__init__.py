"""The engine side of the socket: the Client, its slots and leases, and paged-cache copies.

Imports only :mod:`tierkv.core`: an engine process never loads the daemon, LMDB or redis.
:mod:`~tierkv.client.client` is the API; :mod:`~tierkv.client.connection` the socket and the mapped
pools; :mod:`~tierkv.client.copies` the host copies; :mod:`~tierkv.client.durable` the chunks of a
streamed durable put; :mod:`~tierkv.client.admin` one control request without a namespace.
"""

from typing import Any

__all__ = ["Client", "Lease", "Slots"]  # noqa: F822 - loaded on first use (torch)


def __getattr__(name: str) -> Any:
    # The Client loads torch; the admin client (the CLI, the daemon's own start-up) must not pay for it.
    if name in __all__:
        from tierkv.client import client

        return getattr(client, name)
    raise AttributeError(name)

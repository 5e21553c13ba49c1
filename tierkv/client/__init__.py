"""The engine side of the socket: the Client, its slots and leases, and paged-cache copies.

Imports only :mod:`tierkv.core`: an engine process never loads the daemon, LMDB or redis.
:mod:`~tierkv.client.client` is the API; :mod:`~tierkv.client.connection` the socket and the mapped
pools; :mod:`~tierkv.client.copies` the host copies; :mod:`~tierkv.client.durable` the chunks of a
streamed durable put; :mod:`~tierkv.client.admin` one control request without a namespace.
"""

from tierkv.client.client import Client, Lease, Slots

__all__ = ["Client", "Lease", "Slots"]

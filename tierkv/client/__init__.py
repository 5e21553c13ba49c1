"""The engine side of the socket: the Client, its slots and leases, and paged-cache copies.

Imports only :mod:`tierkv.core`: an engine process never loads the daemon, LMDB or redis.
"""

from tierkv.client.client import Client, Lease, Slots

__all__ = ["Client", "Lease", "Slots"]

"""tierkv: a tiered KV-cache memory manager for LLM inference."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierkv.core.errors import TierKVError
from tierkv.core.layout import Layout

if TYPE_CHECKING:
    from tierkv.client.client import Client

__all__ = ["Client", "Layout", "TierKVError"]  # noqa: F822 - Client is loaded lazily (torch)
__version__ = "0.1.0"


def __getattr__(name: str) -> type[Client]:
    # Client pulls in the protocol stack; import lazily so `import tierkv` stays cheap for tools.
    if name == "Client":
        from tierkv.client import Client

        return Client
    raise AttributeError(name)

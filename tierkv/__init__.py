"""tierkv: a tiered KV-cache memory manager for LLM inference."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from tierkv.core.errors import TierKVError
from tierkv.core.layout import Layout

if TYPE_CHECKING:
    from tierkv.client.client import Client

__all__ = ["Client", "Layout", "TierKVError"]  # noqa: F822 - Client is loaded lazily (torch)
__version__ = "0.1.0"


def __getattr__(name: str) -> type[Client]:
    # Client pulls in the protocol stack; import lazily so `import tierkv` stays cheap for tools. By
    # name, so the import contracts see the root package import no layer above core.
    if name == "Client":
        client: type[Client] = importlib.import_module("tierkv.client").Client
        return client
    raise AttributeError(name)

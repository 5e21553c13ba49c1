"""tierkv: a tiered KV-cache memory manager for LLM inference."""

from tierkv.core.errors import TierKVError
from tierkv.core.layout import Layout

__all__ = ["Client", "Layout", "TierKVError"]  # noqa: F822 - Client is loaded lazily (torch)
__version__ = "0.1.0"


def __getattr__(name: str):
    # Client pulls in the protocol stack; import lazily so `import tierkv` stays cheap for tools.
    if name == "Client":
        from tierkv.client import Client

        return Client
    raise AttributeError(name)

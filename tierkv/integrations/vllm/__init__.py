"""tierkv as vLLM's KV cache: ``TierKVConnector``, a KV connector (v1) for vLLM's
``--kv-transfer-config`` (``"kv_connector_module_path": "tierkv.integrations.vllm"``).

The connector (and with it vLLM) is imported on first use of ``TierKVConnector``; the plain modules
:mod:`.groups`, :mod:`.plan`, :mod:`.ranks`, :mod:`.transfer`, :mod:`.grouped`, :mod:`.asyncload`, :mod:`.pages`
and :mod:`.link` import no vLLM code.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TierKVConnector", "TierKVConnectorMetadata"]  # noqa: F822 - resolved lazily by __getattr__


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tierkv.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

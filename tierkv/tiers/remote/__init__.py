"""Remote tier: block values in a Redis or Valkey shared by the nodes of a fleet.

Modules: :mod:`.url` (URLs, keys), :mod:`.settings` (the ``[remote]`` settings), :mod:`.resp` (reply reader),
:mod:`.breaker` (circuit breakers), :mod:`.connection` (pools), :mod:`.tier` (:class:`RemoteTier`).
The settings and URL helpers load without redis-py (a daemon's config is read before any tier
exists); :class:`RemoteTier` loads it on first use of the name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierkv.tiers.remote.settings import ADMISSION_MODES, RemoteConfig
from tierkv.tiers.remote.url import KEY_PREFIX, Target, parse_remote_url, redact_url, remote_key

if TYPE_CHECKING:
    from tierkv.tiers.remote.tier import RemoteTier

__all__ = ["ADMISSION_MODES", "KEY_PREFIX", "RemoteConfig", "RemoteTier", "Target", "parse_remote_url",
           "redact_url", "remote_key"]


def __getattr__(name: str) -> Any:
    if name == "RemoteTier":
        from tierkv.tiers.remote.tier import RemoteTier

        return RemoteTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

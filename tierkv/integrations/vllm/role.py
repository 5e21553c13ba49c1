"""What each vLLM ``kv_role`` does with tierkv."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Role"]


@dataclass(frozen=True, slots=True)
class Role:
    """What a ``kv_role`` does with tierkv: whether it stores, whether its stores commit before the
    step ends (a producer's prompt must be in tierkv when its response reaches the proxy that sends the
    request on to a consumer), and whether those commits wait for the write-through to the daemon's
    remote tier (a consumer on another node, whose daemon shares it, finds the whole prompt). Every
    role loads: tierkv is a cache, and a lost block is a recompute."""

    stores: bool = True
    commit_in_step: bool = False
    write_through: bool = False

    @classmethod
    def of(cls, kv_role: str | None) -> Role:
        """``kv_both`` (or unset): stores committed behind the step; ``kv_producer``: stores committed
        within it, written through to the remote tier (if the daemon has one) before the commit
        returns; ``kv_consumer``: never stores.

        Raises:
            ValueError: another role.
        """
        if kv_role in (None, "kv_both"):
            return cls()
        if kv_role == "kv_producer":
            return cls(commit_in_step=True, write_through=True)
        if kv_role == "kv_consumer":
            return cls(stores=False)
        raise ValueError(f"kv_role must be kv_both, kv_producer or kv_consumer, got {kv_role!r}")

"""Admission to a cold tier: write a block only if it is likely to be read again.

Each write to NVMe costs bandwidth and endurance, and most blocks of one-shot prompts are never
read again. The rule (TinyLFU's idea): admit a block seen at least ``min_seen``
times, shared by at least ``min_sharers`` holders, or pinned. The counts come from a
:class:`~tierkv.cache.policy.history.History` shared with the policies. This is a rule by past use,
for write-through to the remote tier; the disk tier's rule, by predicted reuse, is
:class:`~tierkv.cache.policy.placement.Placement`.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from tierkv.cache.policy.base import Setting, checked_settings
from tierkv.cache.policy.history import History


class Admission:
    """Decides whether a block demoted from a faster tier is written to this (cold) tier.

    Args:
        history: use counts (shared with the policies); a private one is made if ``None``.
        **settings: see ``SETTINGS``.
    """

    SETTINGS = {
        "enabled": Setting(True, "false admits every block"),
        "min_seen": Setting(2, "admit blocks used at least this many times", min=1),
        "min_sharers": Setting(2, "admit blocks with at least this many leases + children", min=1),
        "admit_pinned": Setting(True, "always admit pinned blocks"),
    }

    def __init__(self, history: History | None = None, **settings: Any) -> None:
        self.history = history if history is not None else History()
        self._settings = {k: s.default for k, s in self.SETTINGS.items()}
        self.update(**settings)
        self.admitted = 0
        self.rejected = 0

    def seen(self, key: Hashable, now: float = 0.0) -> None:
        """Count a use of ``key`` (only needed when the history is not fed by a policy)."""
        self.history.use(key, now, 0.0)

    def admit(self, key: Hashable, *, sharers: int = 0, pinned: bool = False) -> bool:
        """Whether ``key`` should be written to the tier; counts the decision."""
        s = self._settings
        ok = (not s["enabled"] or (pinned and s["admit_pinned"]) or sharers >= s["min_sharers"]
              or self.history.seen(key) >= s["min_seen"])
        if ok:
            self.admitted += 1
        else:
            self.rejected += 1
        return ok

    def settings(self) -> dict[str, Any]:
        """The effective settings (a copy)."""
        return dict(self._settings)

    def update(self, **settings: Any) -> None:
        """Change settings; a bad key or value raises ``ValueError`` and changes nothing."""
        self._settings = checked_settings(self.SETTINGS, self._settings, settings, "admission")


def admission_for(mode: str = "reused", history: History | None = None) -> Admission:
    """The :class:`Admission` of a write-through mode (``remote.admission``), for the simulator and for
    callers that keep use counts in a History.

    ``all``: every block; ``reused``: blocks used at least twice, shared by two holders, or pinned;
    ``pinned``: pinned blocks only.

    Raises:
        ValueError: an unknown mode.
    """
    if mode == "all":
        return Admission(history, enabled=False)
    if mode == "reused":
        return Admission(history)
    if mode == "pinned":
        return Admission(history, min_seen=1 << 62, min_sharers=1 << 62)
    raise ValueError(f"admission mode must be one of all, reused, pinned, got {mode!r}")

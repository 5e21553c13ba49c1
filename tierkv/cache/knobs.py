"""Named, typed settings of the cache's decisions (policies, reuse models, the admission rule, the store
gate): each :class:`Setting` says its default, bounds and meaning, checks a new value (from a config file,
the wire or ``tierkv tune``, as any ``object``), and the checked values are read back by their type
(:class:`Values`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Setting", "Value", "Values", "checked_settings"]

Value = bool | int | float | str  # a setting's value, of its default's type


class Values(dict[str, Value]):
    """Settings by name (each checked by its :class:`Setting`), read by their type."""

    def number(self, name: str) -> float:
        """A numeric setting (a flag reads as 0 or 1)."""
        value = self[name]
        if isinstance(value, str):
            raise TypeError(f"setting {name!r} is text, not a number")
        return value

    def count(self, name: str) -> int:
        """An integer setting."""
        value = self[name]
        if not isinstance(value, int):
            raise TypeError(f"setting {name!r} is not an integer")
        return value

    def text(self, name: str) -> str:
        """A text setting."""
        value = self[name]
        if not isinstance(value, str):
            raise TypeError(f"setting {name!r} is not text")
        return value


@dataclass(frozen=True)
class Setting:
    """One tunable value of a policy: its default, type, bounds and meaning."""

    default: Value
    doc: str
    min: float | None = None
    max: float | None = None
    choices: tuple[Value, ...] | None = None

    def coerce(self, name: str, value: object) -> Value:
        """Return ``value`` converted to this setting's type, or raise ``ValueError``.

        Strings are accepted (they come from ``tierkv tune KEY=VALUE`` and the CLI).
        """
        kind = type(self.default)
        out: Value
        try:
            if kind is bool:
                if isinstance(value, str):
                    low = value.strip().lower()
                    if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                        raise ValueError(value)
                    value = low in ("1", "true", "yes", "on")
                elif not isinstance(value, (bool, int)):
                    raise ValueError(value)
                out = bool(value)
            elif kind is int:
                if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                    raise ValueError(value)
                if not isinstance(value, (int, float, str)):
                    raise TypeError(value)
                out = int(value)
            elif kind is float:
                if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                    raise ValueError(value)
                out = float(value)
                if math.isnan(out):
                    raise ValueError(value)
            else:
                out = str(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name}: expected {kind.__name__}, got {value!r}") from None
        if not isinstance(out, str):
            if self.min is not None and out < self.min:
                raise ValueError(f"{name}: {out!r} is below the minimum {self.min}")
            if self.max is not None and out > self.max:
                raise ValueError(f"{name}: {out!r} is above the maximum {self.max}")
        if self.choices is not None and out not in self.choices:
            raise ValueError(f"{name}: {out!r} is not one of {', '.join(map(str, self.choices))}")
        return out


def checked_settings(specs: dict[str, Setting], current: Mapping[str, Value], updates: Mapping[str, object],
                     owner: str) -> Values:
    """``current`` with ``updates`` coerced by ``specs``; an unknown key or bad value raises ``ValueError``."""
    new = Values(current)
    for key, value in updates.items():
        spec = specs.get(key)
        if spec is None:
            known = ", ".join(sorted(specs)) or "none"
            raise ValueError(f"{owner} has no setting {key!r} (settings: {known})")
        new[key] = spec.coerce(key, value)
    return new

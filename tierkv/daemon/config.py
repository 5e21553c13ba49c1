"""Settings: a dataclass per component (:mod:`~tierkv.daemon.sections`). Precedence: defaults < TOML file <
``TIERKV_*`` env < CLI flags.

Every field is documented; ``validate()`` raises ``ValueError`` with the offending key. ``Config.sources``
records where each effective value came from (shown by ``tierkv config``).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args, get_origin, get_type_hints

from tierkv.core.paths import default_runtime_dir, default_socket
from tierkv.core.units import parse_size
from tierkv.daemon.sections import (
    BudgetConfig,
    DiskConfig,
    EventsConfig,
    GpuConfig,
    HostConfig,
    ServerConfig,
    StoreConfig,
)
from tierkv.tiers.remote import RemoteConfig  # the remote tier documents its own settings

__all__ = ["BudgetConfig", "Config", "DiskConfig", "EventsConfig", "GpuConfig", "HostConfig", "RemoteConfig",
           "ServerConfig", "StoreConfig", "default_runtime_dir", "default_socket", "load_config"]


@dataclass
class Config:
    """All settings of one daemon."""

    server: ServerConfig = field(default_factory=ServerConfig)
    host: HostConfig = field(default_factory=HostConfig)
    disk: DiskConfig = field(default_factory=DiskConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    policy: dict[str, object] = field(default_factory=dict)
    """Policy weights (``[policy]`` table, ``policy.<name>`` keys), applied to every tier whose policy has them."""
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    SECTIONS = ("server", "host", "disk", "gpu", "budget", "remote", "events", "store", "policy")

    @property
    def socket_path(self) -> str:
        """The effective socket path."""
        return self.server.socket or default_socket()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting."""
        for section in (self.server, self.host, self.disk, self.gpu, self.store):
            section.validate()
        _check_policies(self)
        self.events.validate()
        self.budget.validate()
        from tierkv.codecs import available_codecs

        self.remote.validate(available_codecs())

    def policy_settings(self, name: str) -> dict[str, object]:
        """The ``[policy]`` settings that the policy ``name`` has."""
        from tierkv.cache.policy import policy_class

        known = policy_class(name).SETTINGS
        return {k: v for k, v in self.policy.items() if k in known}

    def to_dict(self) -> dict[str, dict[str, object]]:
        """Effective settings as nested plain dicts."""
        out: dict[str, dict[str, object]] = {name: dataclasses.asdict(getattr(self, name)) for name in self.SECTIONS if name != "policy"}
        out["policy"] = dict(self.policy)
        return out

    def set(self, dotted: str, value: object, source: str) -> None:
        """Set ``section.key`` from a string or typed value, converting to the field's type."""
        section, _, key = dotted.partition(".")
        if section not in self.SECTIONS or not key:
            raise ValueError(f"unknown setting {dotted!r} (sections: {', '.join(self.SECTIONS)})")
        if section == "policy":  # free-form weights, checked against the policies in validate()
            self.policy[key] = value
            self.sources[dotted] = source
            return
        obj = getattr(self, section)
        hints = get_type_hints(type(obj))
        if key not in hints:
            raise ValueError(f"unknown setting {dotted!r}; {section} has: {', '.join(hints)}")
        setattr(obj, key, _convert(dotted, hints[key], value, key))
        self.sources[dotted] = source


def _check_policies(cfg: Config) -> None:
    from tierkv.cache.policy import policy_class, policy_names

    for name, chosen in (("host.policy", cfg.host.policy), ("disk.policy", cfg.disk.policy)):
        if chosen not in policy_names():
            raise ValueError(f"{name}: unknown policy {chosen!r} (known: {', '.join(policy_names())})")
    # A weight is kept even while the active policies lack it (it applies when one that has it is
    # chosen); a key no built-in policy knows is a typo.
    every = {n: policy_class(n).SETTINGS for n in policy_names()}
    for key, value in cfg.policy.items():
        owners = [n for n, settings in every.items() if key in settings]
        if not owners:
            known = sorted({k for settings in every.values() for k in settings})
            raise ValueError(f"policy.{key}: no policy has this setting (settings: {', '.join(known)})")
        for n in owners:
            every[n][key].coerce(f"policy.{key}", value)


_SIZE_KEYS = {"capacity", "slab_bytes", "max_frame_bytes", "host_disk", "gpu_host", "host_remote", "batch_bytes"}


def _convert(name: str, typ: object, value: object, key: str) -> object:
    try:
        if key in _SIZE_KEYS:
            return parse_size(_scalar(value))
        if typ is bool:
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"expected a boolean, got {value!r}")
        if typ is int:
            if isinstance(value, bool):
                raise ValueError("expected an integer")
            return int(_scalar(value))
        if typ is float:
            return float(_scalar(value))
        if typ is str:
            if not isinstance(value, str):
                raise ValueError("expected a string")
            return value
        if get_origin(typ) is Literal:
            if value not in get_args(typ):
                raise ValueError(f"expected one of {get_args(typ)}")
            return value
        if get_origin(typ) is list:
            if isinstance(value, str):
                value = [v for v in value.split(",") if v.strip()]
            if not isinstance(value, (list, tuple)):
                raise ValueError("expected a list")
            return [int(_scalar(v)) for v in value]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad value for {name}: {value!r} ({exc})") from None
    raise ValueError(f"cannot set {name}")


def _scalar(value: object) -> int | float | str:
    """A number or text from a config file, the environment or a flag (anything else is a TypeError)."""
    if isinstance(value, (int, float, str)):
        return value
    raise TypeError(f"expected a number, got {type(value).__name__}")


def load_config(path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
                overrides: dict[str, object] | None = None) -> Config:
    """Build the effective config: defaults < TOML ``path`` < ``TIERKV_SECTION_KEY`` env < ``overrides``.

    Args:
        path: a TOML file with ``[server]``, ``[host]``, ``[disk]`` tables (optional).
        env: environment to read (``os.environ`` by default), e.g. ``TIERKV_HOST_CAPACITY=8GiB``.
        overrides: dotted keys to values, e.g. ``{"host.capacity": "8GiB"}`` (from CLI flags).
    """
    cfg = Config()
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except OSError as exc:
            raise ValueError(f"cannot read config {p}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"bad TOML in {p}: {exc}") from None
        for section, table in data.items():
            if section not in cfg.SECTIONS or not isinstance(table, dict):
                raise ValueError(f"{p}: unknown section [{section}]")
            for key, value in table.items():
                cfg.set(f"{section}.{key}", value, f"file:{p}")
    env = os.environ if env is None else env
    for name, value in env.items():
        if not name.startswith("TIERKV_"):
            continue
        rest = name[len("TIERKV_"):].lower()
        section, _, key = rest.partition("_")
        if section in cfg.SECTIONS and section != "policy" and key:
            cfg.set(f"{section}.{key}", value, f"env:{name}")
    if "TIERKV_SOCKET" in env and "server.socket" not in cfg.sources:
        cfg.set("server.socket", env["TIERKV_SOCKET"], "env:TIERKV_SOCKET")
    for dotted, value in (overrides or {}).items():
        if value is not None:
            cfg.set(dotted, value, "flag")
    cfg.validate()
    return cfg

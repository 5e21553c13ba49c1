"""Settings: a dataclass per component. Precedence: defaults < TOML file < ``TIERKV_*`` env < CLI flags.

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
from typing import Any, Literal, get_args, get_type_hints

from tierkv.core.paths import default_runtime_dir, default_socket  # noqa: F401 - re-exported for the daemon and CLI
from tierkv.core.units import parse_size


@dataclass
class ServerConfig:
    """The daemon process."""

    socket: str = ""
    """Unix socket path (0600 in a 0700 directory); empty means the default path."""
    data_dir: str = ".tierkv"
    """Directory for the disk tier (created 0700; refused if a symlink or writable by others)."""
    allow_uids: list[int] = field(default_factory=list)
    """Extra uids allowed to connect besides the daemon's own (checked with SO_PEERCRED)."""
    max_frame_bytes: int = 16 << 20
    """Largest control frame accepted; checked before allocating."""
    max_clients: int = 256
    """Connections above this are refused."""
    lookup_index_slots: int = 1 << 20
    """Slots of the shared lookup index clients answer ``lookup`` from (8 bytes each; it holds up to 3/4
    as many blocks, beyond that lookups go through the socket). 0: every lookup goes through the socket."""
    drain_timeout_s: float = 30.0
    """On SIGTERM: how long to wait for in-flight writes and the shutdown flush."""
    slot_wait_s: float = 30.0
    """Longest wait for a host slot when every block is in use (leased, moving or pinned), or a GPU slot
    while blocks drain; a caller may ask for less (the vLLM connector's stores ask for none)."""
    commit_wait_s: float = 30.0
    """Longest wait of a GPU commit for its blocks to reach host memory (durable or remote) and of a
    remote commit for its write-through."""
    flush_on_shutdown: bool = True
    """On SIGTERM, write host-tier blocks that are not yet on disk to the disk tier (a warm next start)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Daemon log level (logs go to stderr)."""
    metrics_addr: str = ""
    """Prometheus ``/metrics`` endpoint, ``HOST:PORT`` or ``PORT`` (loopback); empty: no endpoint."""
    sample_interval_s: float = 1.0
    """Seconds between the samples behind ``tierkv stats --plot`` (0: no samples)."""
    sample_count: int = 900
    """Samples kept (the newest; 900 at 1 s is the last 15 minutes)."""


@dataclass
class HostConfig:
    """The host-memory tier: one shared-memory pool (memfd) split into slabs of fixed-size slots."""

    capacity: int = 1 << 30
    """Bytes of shared memory for block slots."""
    slab_bytes: int = 32 << 20
    """Slab size; a namespace's slot must fit in one slab. Slabs move between slot sizes as needed. A
    host tier smaller than one slab is one slab of its own size."""
    high_watermark: float = 0.95
    """Start demoting to disk when used/capacity exceeds this."""
    low_watermark: float = 0.85
    """Demote until used/capacity falls below this."""
    prefault: bool = True
    """Allocate the pool's memory at start (fails early if memory is short; no page faults later)."""
    policy: str = "attention"
    """Eviction policy for this tier (lru, lfu, slru, gdsf, attention)."""
    shadow_rate: float = 0.1
    """With the ``attention`` policy: the fraction of the chains' branches (by hash) on which its order and LRU are
    simulated side by side at that fraction of the tier's bytes; the tier evicts in LRU order while LRU
    hits clearly more there (0: off, the score alone)."""
    max_pinned_fraction: float = 0.5
    """Pinned prefixes may hold at most this share of the host tier."""
    write_behind: bool = True
    """While the disk is idle, write blocks the disk tier admits ahead of eviction (coldest first), so
    that a burst of stores finds clean blocks to evict and never waits for the disk."""
    write_behind_above: float = 0.5
    """Write behind only while the host tier is fuller than this share of its capacity."""
    prefetch_fraction: float = 0.25
    """Blocks prefetched for queued requests and not used yet hold at most this share of the tier."""


@dataclass
class DiskConfig:
    """The disk tier: one LMDB environment in the data directory."""

    enabled: bool = True
    """Turn the disk tier off to run host-only."""
    capacity: int = 16 << 30
    """Bytes of stored (encoded) blocks; the LMDB map is sized from this."""
    codec: str = "lossless"
    """Codec for new writes (old blocks stay readable after a change)."""
    codec_level: int = 1
    """zstd level used by the codec."""
    high_watermark: float = 0.95
    """Drop blocks (those ``policy`` picks) when used/capacity exceeds this."""
    low_watermark: float = 0.90
    """Drop until used/capacity falls below this."""
    workers: int = 2
    """Encode/decode worker threads (zstd releases the GIL)."""
    write_nice: int = 10
    """CPU nice steps of the threads that encode and write blocks to disk (0: the daemon's own): writes
    behind the engine take the cores it leaves idle. Loads keep the daemon's priority."""
    sync: bool = True
    """fsync each write transaction (required for durable acknowledgements)."""
    write_batch: int = 256
    """Most blocks written in one LMDB transaction (transactions also stop at about 48 MiB)."""
    policy: str = "attention"
    """Eviction policy for this tier: what to drop above the high watermark (lru, lfu, slru, gdsf, attention)."""
    idle_aging: float = 0.5
    """The ``attention`` disk order halves a block's value every ``tau`` seconds without a use, ``tau``
    being this times the mean idle time of the disk's recent victims (0: the GDSF aging clock the host
    tier uses): a conversation idle for long goes before a busier one."""
    admission: Literal["predicted", "all", "reused", "pinned"] = "predicted"
    """Which host victims are written to disk: ``predicted`` (every one while the writer keeps up; under
    pressure those whose learned chance of a return, times the recompute time saved, beats the write),
    every one, those used twice / shared / pinned, or pinned only. Durable puts and the shutdown flush
    are always written."""
    shadow_rate: float = 0.1
    """With ``predicted`` admission: the fraction of the chains' branches (by hash) whose host victims
    feed two small LRU caches at that fraction of the disk's bytes, one taking the victims the rule
    writes and one every victim; every victim is written while write-all hits clearly more there
    (0: off, the rule alone)."""
    order_shadow_rate: float = 0.1
    """With the ``attention`` policy: the fraction of the chains' branches (by hash) on which its order and
    LRU are simulated side by side over the disk's references (the blocks requests used that host memory
    did not hold) at that fraction of the disk's bytes; the disk evicts in LRU order while LRU hits
    clearly more there (0: off, the score alone)."""


@dataclass
class GpuConfig:
    """The GPU tier: device memory shared with the engine through a CUDA IPC handle (off by default)."""

    capacity: int = 0
    """Bytes of device memory for block slots; 0 turns the tier off."""
    device: str = "auto"
    """auto (CUDA if torch sees a GPU, else the CPU stand-in), cuda, cuda:N, or cpu (the stand-in)."""
    slab_bytes: int = 32 << 20
    """Slab size of the device pool (a namespace's slot must fit in one slab); capped at the capacity."""


@dataclass
class BudgetConfig:
    """Bandwidth caps per link in bytes/s (0 = unlimited), so offload traffic cannot starve decode."""

    host_disk: int = 0
    """host <-> disk."""
    gpu_host: int = 0
    """gpu <-> host."""
    host_remote: int = 0
    """host <-> remote."""


@dataclass
class EventsConfig:
    """KV events for routers: every tier copy a block gains or loses, in vLLM's KV-events format."""

    endpoint: str = ""
    """ZMQ PUB endpoint, e.g. ``tcp://*:5557`` (bound; ``ipc://`` too) or ``tcp://host:port`` (connected
    to a broker); empty: no events."""
    replay_endpoint: str = ""
    """ZMQ ROUTER endpoint that resends recent batches from a sequence number; empty: no replay."""
    topic: str = ""
    """Topic frame of every message."""
    buffer_steps: int = 10_000
    """Batches kept for replay."""
    interval_ms: int = 20
    """Longest time a change waits before its batch is sent."""


from tierkv.tiers.remote import RemoteConfig  # noqa: E402 - the remote tier documents its own settings


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
    policy: dict[str, Any] = field(default_factory=dict)
    """Policy weights (``[policy]`` table, ``policy.<name>`` keys), applied to every tier whose policy has them."""
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    SECTIONS = ("server", "host", "disk", "gpu", "budget", "remote", "events", "policy")

    @property
    def socket_path(self) -> str:
        """The effective socket path."""
        return self.server.socket or default_socket()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting."""
        _check_server(self.server)
        _check_host(self.host)
        _check_disk(self.disk)
        _check_gpu(self.gpu)
        _check_policies(self)
        _check_events(self.events)
        for name in ("host_disk", "gpu_host", "host_remote"):
            if getattr(self.budget, name) < 0:
                raise ValueError(f"budget.{name} must be >= 0")
        from tierkv.codecs import available_codecs

        self.remote.validate(available_codecs())

    def policy_settings(self, name: str) -> dict[str, Any]:
        """The ``[policy]`` settings that the policy ``name`` has."""
        from tierkv.cache.policy import policy_class

        known = policy_class(name).SETTINGS
        return {k: v for k, v in self.policy.items() if k in known}

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Effective settings as nested plain dicts."""
        out = {name: dataclasses.asdict(getattr(self, name)) for name in self.SECTIONS if name != "policy"}
        out["policy"] = dict(self.policy)
        return out

    def set(self, dotted: str, value: Any, source: str) -> None:
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


def _check_events(e: EventsConfig) -> None:
    for name in ("endpoint", "replay_endpoint"):
        value = getattr(e, name)
        if value and not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"events.{name} must be a tcp://, ipc:// or inproc:// endpoint, got {value!r}")
        port = value[len("tcp://"):].rpartition(":")[2] if value.startswith("tcp://") else "0"
        if not (port == "*" or (port.isdigit() and int(port) <= 65535)):
            raise ValueError(f"events.{name}: {value!r} needs a port within 0..65535 (tcp://*:5557)")
    if e.replay_endpoint and not e.endpoint:
        raise ValueError("events.replay_endpoint needs events.endpoint")
    if not 1 <= e.buffer_steps <= 1 << 20 or not 1 <= e.interval_ms <= 10_000:
        raise ValueError("events.buffer_steps must be within 1..2^20 and events.interval_ms within 1..10000")


def _check_server(s: ServerConfig) -> None:
    if s.lookup_index_slots != 0 and not 1024 <= s.lookup_index_slots <= 1 << 30:
        raise ValueError("server.lookup_index_slots must be 0 (off) or between 1024 and 2^30")
    if s.max_frame_bytes < 4096:
        raise ValueError("server.max_frame_bytes must be >= 4096")
    if s.drain_timeout_s < 0:
        raise ValueError("server.drain_timeout_s must be >= 0")
    for name in ("slot_wait_s", "commit_wait_s"):
        if not 0 <= getattr(s, name) <= 3600:
            raise ValueError(f"server.{name} must be within 0..3600")
    if s.sample_interval_s < 0 or not 1 <= s.sample_count <= 1 << 20:
        raise ValueError("server.sample_interval_s must be >= 0 and server.sample_count within 1..2^20")
    if s.metrics_addr:
        from tierkv.daemon.metrics import parse_addr

        parse_addr(s.metrics_addr)


def _check_host(h: HostConfig) -> None:
    if h.capacity < 4096:
        raise ValueError("host.capacity must be at least 4 KiB")
    if h.slab_bytes < 4096 or h.slab_bytes % 4096:
        raise ValueError("host.slab_bytes must be a multiple of 4 KiB (at least 4 KiB)")
    _check_watermarks("host", h.low_watermark, h.high_watermark)
    if not 0 <= h.shadow_rate <= 1:
        raise ValueError(f"host.shadow_rate must be within 0..1, got {h.shadow_rate!r}")
    if not 0 <= h.write_behind_above <= 1:
        raise ValueError("host.write_behind_above must be within 0..1")
    if not 0 <= h.prefetch_fraction <= 1:
        raise ValueError("host.prefetch_fraction must be within 0..1")
    if not 0 <= h.max_pinned_fraction <= 1:
        raise ValueError("host.max_pinned_fraction must be within 0..1")


def _check_disk(d: DiskConfig) -> None:
    _check_watermarks("disk", d.low_watermark, d.high_watermark)
    if d.enabled and d.capacity < (1 << 20):
        raise ValueError("disk.capacity must be at least 1 MiB")
    if d.workers < 1 or d.workers > 64:
        raise ValueError("disk.workers must be between 1 and 64")
    if d.write_batch < 1:
        raise ValueError("disk.write_batch must be >= 1")
    if not 0 <= d.write_nice <= 19:
        raise ValueError("disk.write_nice must be within 0..19")
    if not 0 <= d.idle_aging <= 100:
        raise ValueError(f"disk.idle_aging must be between 0 and 100, got {d.idle_aging!r}")
    if not 0 <= d.shadow_rate <= 1:
        raise ValueError(f"disk.shadow_rate must be within 0..1, got {d.shadow_rate!r}")
    if not 0 <= d.order_shadow_rate <= 1:
        raise ValueError(f"disk.order_shadow_rate must be within 0..1, got {d.order_shadow_rate!r}")
    from tierkv.codecs import available_codecs

    if d.codec not in available_codecs():
        raise ValueError(f"disk.codec: unknown codec {d.codec!r} (known: {', '.join(available_codecs())})")


def _check_watermarks(name: str, low: float, high: float) -> None:
    if not (0 < low <= high <= 1):
        raise ValueError(f"{name} watermarks must satisfy 0 < low <= high <= 1")


def _check_gpu(g: GpuConfig) -> None:
    if g.capacity < 0:
        raise ValueError("gpu.capacity must be >= 0 (0 turns the GPU tier off)")
    if g.slab_bytes < 4096 or g.slab_bytes % 4096:
        raise ValueError("gpu.slab_bytes must be a multiple of 4 KiB (at least 4 KiB)")
    dev = g.device.strip().lower()
    if not (dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())):
        raise ValueError(f"gpu.device: expected auto, cpu, cuda or cuda:N, got {g.device!r}")


def _check_policies(cfg: Config) -> None:
    from tierkv.cache.policy import policy_class, policy_names

    for name, value in (("host.policy", cfg.host.policy), ("disk.policy", cfg.disk.policy)):
        if value not in policy_names():
            raise ValueError(f"{name}: unknown policy {value!r} (known: {', '.join(policy_names())})")
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


def _convert(name: str, typ: Any, value: Any, key: str) -> Any:
    try:
        if key in _SIZE_KEYS:
            return parse_size(value)
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
            return int(value)
        if typ is float:
            return float(value)
        if typ is str:
            if not isinstance(value, str):
                raise ValueError("expected a string")
            return value
        if getattr(typ, "__origin__", None) is Literal:
            if value not in get_args(typ):
                raise ValueError(f"expected one of {get_args(typ)}")
            return value
        if getattr(typ, "__origin__", None) is list:
            if isinstance(value, str):
                value = [v for v in value.split(",") if v.strip()]
            return [int(v) for v in value]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad value for {name}: {value!r} ({exc})") from None
    raise ValueError(f"cannot set {name}")


def load_config(path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
                overrides: dict[str, Any] | None = None) -> Config:
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

"""The daemon's settings sections: one dataclass per component (``[server]``, ``[host]``, ``[disk]``,
``[gpu]``, ``[budget]``, ``[events]``), each documenting its fields and checking its own values.
:class:`~tierkv.daemon.config.Config` holds one of each (and the remote tier's, which it documents
itself)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["BudgetConfig", "DiskConfig", "EventsConfig", "GpuConfig", "HostConfig", "ServerConfig", "StoreConfig",
           "check_watermarks"]


def parse_addr(addr: str) -> tuple[str, int]:
    """``"9464"`` -> ``("127.0.0.1", 9464)``; ``"HOST:PORT"`` and ``"[V6]:PORT"`` as given.

    Raises:
        ValueError: not a port or HOST:PORT with a port in 1..65535.
    """
    text = str(addr).strip()
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"server.metrics_addr: expected PORT or HOST:PORT (port 1..65535), got {addr!r}")
    return host, int(port)


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
    """Prometheus ``/metrics`` endpoint, ``HOST:PORT`` or ``PORT`` (loopback); empty: no endpoint. The
    control API (``/v1/...``) is served beside it."""
    control_token_file: str = ""
    """A file holding the bearer token the control API's pin, unpin, warm and delete need (at least 16
    characters); empty: those are refused (``GET /v1/status`` stays open)."""
    sample_interval_s: float = 1.0
    """Seconds between the samples behind ``tierkv stats --plot`` (0: no samples)."""
    sample_count: int = 900
    """Samples kept (the newest; 900 at 1 s is the last 15 minutes)."""
    synchronous: bool = False
    """Decide on a clock a client moves before each request (``Client.set_clock``) and let a store that
    needs room wait for the whole demotion it asked for: one trace fed request by request gives one
    result, the one ``tierkv replay`` computes. Off: the monotonic clock, and a store goes on as soon as
    a slot frees."""


    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting of this section."""
        if self.lookup_index_slots != 0 and not 1024 <= self.lookup_index_slots <= 1 << 30:
            raise ValueError("server.lookup_index_slots must be 0 (off) or between 1024 and 2^30")
        if self.max_frame_bytes < 4096:
            raise ValueError("server.max_frame_bytes must be >= 4096")
        if self.drain_timeout_s < 0:
            raise ValueError("server.drain_timeout_s must be >= 0")
        for name in ("slot_wait_s", "commit_wait_s"):
            if not 0 <= getattr(self, name) <= 3600:
                raise ValueError(f"server.{name} must be within 0..3600")
        if self.sample_interval_s < 0 or not 1 <= self.sample_count <= 1 << 20:
            raise ValueError("server.sample_interval_s must be >= 0 and server.sample_count within 1..2^20")
        if self.metrics_addr:
            parse_addr(self.metrics_addr)

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
    write_behind_idle_cores: float = 1.0
    """Start a write-behind batch only while other processes (the engine) left at least this many cores
    idle on average over the last half second (Linux; 0: whatever the load). The batch's writes into
    the page cache run in the kernel, where an engine thread that wakes waits for them."""
    prefetch_fraction: float = 0.25
    """Blocks prefetched for queued requests and not used yet hold at most this share of the tier."""


    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting of this section."""
        if self.capacity < 4096:
            raise ValueError("host.capacity must be at least 4 KiB")
        if self.slab_bytes < 4096 or self.slab_bytes % 4096:
            raise ValueError("host.slab_bytes must be a multiple of 4 KiB (at least 4 KiB)")
        check_watermarks("host", self.low_watermark, self.high_watermark)
        if not 0 <= self.shadow_rate <= 1:
            raise ValueError(f"host.shadow_rate must be within 0..1, got {self.shadow_rate!r}")
        if not 0 <= self.write_behind_above <= 1:
            raise ValueError("host.write_behind_above must be within 0..1")
        if not 0 <= self.write_behind_idle_cores <= 4096:
            raise ValueError(f"host.write_behind_idle_cores must be within 0..4096, got {self.write_behind_idle_cores!r}")
        if not 0 <= self.prefetch_fraction <= 1:
            raise ValueError("host.prefetch_fraction must be within 0..1")
        if not 0 <= self.max_pinned_fraction <= 1:
            raise ValueError("host.max_pinned_fraction must be within 0..1")

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
    write_idle: bool = False
    """Run those threads in the idle scheduling class instead of nice (Linux): they get a core only when
    no other thread wants it."""
    write_behind_idle: bool = True
    """Encode write-behind (blocks written ahead of eviction, which nothing waits for) on threads in the
    idle scheduling class (Linux); such a batch gives way to any write queued behind it that is not
    encoded there (a demotion unless ``demote_idle``, a durable put, the shutdown flush)."""
    background_share: float = 0.25
    """Cores that demotions and write-behind (encodes and disk writes no request waits for) may use while
    the engine keeps the cores busy (``host.write_behind_idle_cores`` says when); they catch up while it
    leaves cores idle. 0: no bound. A durable put, a load and the shutdown flush are never held back."""
    demote_idle: bool = False
    """Encode demotions (host victims written on their way out, which only the evictor waits for) as
    write-behind is, in the idle class while ``write_behind_idle`` is on: a store that finds host memory
    full of blocks not written yet drops some unwritten instead of waiting. Such a batch gives way to a
    durable put or the shutdown flush queued behind it."""
    sync: bool = True
    """fsync each write transaction (required for durable acknowledgements)."""
    write_batch: int = 256
    """Most blocks written in one LMDB transaction (transactions also stop at about 48 MiB)."""
    max_pinned_fraction: float = 0.5
    """Prefixes pinned on disk (``pin --tier disk``) may hold at most this share of the disk tier."""
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
    spare_writes: bool = True
    """With ``predicted`` admission: while the disk writer has nothing queued, every host victim is
    written (false: the rule decides each one, as ``tierkv replay`` does without ``--disk-write-bw``)."""
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


    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting of this section."""
        check_watermarks("disk", self.low_watermark, self.high_watermark)
        if self.enabled and self.capacity < (1 << 20):
            raise ValueError("disk.capacity must be at least 1 MiB")
        if self.workers < 1 or self.workers > 64:
            raise ValueError("disk.workers must be between 1 and 64")
        if self.write_batch < 1:
            raise ValueError("disk.write_batch must be >= 1")
        if not 0 <= self.write_nice <= 19:
            raise ValueError("disk.write_nice must be within 0..19")
        if not 0 <= self.background_share <= 4096:
            raise ValueError(f"disk.background_share must be within 0..4096 cores, got {self.background_share!r}")
        if not 0 <= self.idle_aging <= 100:
            raise ValueError(f"disk.idle_aging must be between 0 and 100, got {self.idle_aging!r}")
        if not 0 <= self.shadow_rate <= 1:
            raise ValueError(f"disk.shadow_rate must be within 0..1, got {self.shadow_rate!r}")
        if not 0 <= self.order_shadow_rate <= 1:
            raise ValueError(f"disk.order_shadow_rate must be within 0..1, got {self.order_shadow_rate!r}")
        from tierkv.codecs import available_codecs

        if self.codec not in available_codecs():
            raise ValueError(f"disk.codec: unknown codec {self.codec!r} (known: {', '.join(available_codecs())})")

@dataclass
class GpuConfig:
    """The GPU tier: device memory shared with the engine through a CUDA IPC handle (off by default)."""

    capacity: int = 0
    """Bytes of device memory for block slots; 0 turns the tier off."""
    device: str = "auto"
    """auto (CUDA if torch sees a GPU, else the CPU stand-in), cuda, cuda:N, or cpu (the stand-in)."""
    slab_bytes: int = 32 << 20
    """Slab size of the device pool (a namespace's slot must fit in one slab); capped at the capacity."""


    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting of this section."""
        if self.capacity < 0:
            raise ValueError("gpu.capacity must be >= 0 (0 turns the GPU tier off)")
        if self.slab_bytes < 4096 or self.slab_bytes % 4096:
            raise ValueError("gpu.slab_bytes must be a multiple of 4 KiB (at least 4 KiB)")
        dev = self.device.strip().lower()
        if not (dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())):
            raise ValueError(f"gpu.device: expected auto, cpu, cuda or cuda:N, got {self.device!r}")

@dataclass
class BudgetConfig:
    """Bandwidth caps per link in bytes/s (0 = unlimited), so offload traffic cannot starve decode."""

    host_disk: int = 0
    """host <-> disk."""
    gpu_host: int = 0
    """gpu <-> host."""
    host_remote: int = 0
    """host <-> remote."""


    def validate(self) -> None:
        """Raise ``ValueError`` naming the first negative rate."""
        for name in ("host_disk", "gpu_host", "host_remote"):
            if getattr(self, name) < 0:
                raise ValueError(f"budget.{name} must be >= 0")

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


    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting of this section."""
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"events.{name} must be a tcp://, ipc:// or inproc:// endpoint, got {value!r}")
            port = value[len("tcp://"):].rpartition(":")[2] if value.startswith("tcp://") else "0"
            if not (port == "*" or (port.isdigit() and int(port) <= 65535)):
                raise ValueError(f"events.{name}: {value!r} needs a port within 0..65535 (tcp://*:5557)")
        if self.replay_endpoint and not self.endpoint:
            raise ValueError("events.replay_endpoint needs events.endpoint")
        if not 1 <= self.buffer_steps <= 1 << 20 or not 1 <= self.interval_ms <= 10_000:
            raise ValueError("events.buffer_steps must be within 1..2^20 and events.interval_ms within 1..10000")


@dataclass
class StoreConfig:
    """Which of a request's new blocks an engine stores (the store gate, :mod:`tierkv.cache.store_gate`)."""

    gate: Literal["predicted", "all"] = "predicted"
    """``predicted``: the engine's connector stores a request's new blocks while the learned chance that
    blocks at their position in the chain come back, times the seconds recomputing one costs, beats the
    seconds storing it costs (a workload without reuse stores almost nothing); ``all``: every block."""
    cost_bytes_per_s: int = 16 << 30
    """What storing a block costs the engine, as bytes per second: a block of ``B`` bytes costs
    ``B / cost_bytes_per_s`` seconds (the default is a copy out of GPU memory; on a CPU engine, whose
    cores also run the daemon's commits, encodes and disk writes, about 1 GiB/s)."""
    min_return: float = 0.05
    """Blocks at a position that comes back less often than this are not stored, whatever the costs say."""
    prior_weight: float = 1.0
    """Offers the gate's prior return chance (0.3) weighs as, for a position it has seen few offers of:
    higher stores more of a workload's first requests (more hits where blocks come back, more stored
    where none do)."""
    idle_prior_weight: float = 3.0
    """As ``prior_weight``, for the blocks the vLLM connector stores after their request ends while the
    engine has no other request (0: none): an idle engine stores more of a workload's first requests at
    no cost to a step."""


    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting of this section."""
        if self.gate not in ("predicted", "all"):
            raise ValueError(f"store.gate must be predicted or all, got {self.gate!r}")
        if self.cost_bytes_per_s <= 0:
            raise ValueError("store.cost_bytes_per_s must be > 0")
        if not 0 <= self.min_return <= 1:
            raise ValueError(f"store.min_return must be within 0..1, got {self.min_return!r}")
        if not self.prior_weight >= 0.1:
            raise ValueError(f"store.prior_weight must be >= 0.1, got {self.prior_weight!r}")
        if not self.idle_prior_weight >= 0:
            raise ValueError(f"store.idle_prior_weight must be >= 0, got {self.idle_prior_weight!r}")


def check_watermarks(name: str, low: float, high: float) -> None:
    """Raise ``ValueError`` unless ``0 < low <= high <= 1``."""
    if not (0 < low <= high <= 1):
        raise ValueError(f"{name} watermarks must satisfy 0 < low <= high <= 1")

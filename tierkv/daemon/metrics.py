"""Prometheus ``/metrics`` for the daemon (``tierkv serve --metrics-addr``), and ``/lookup`` for routers.

A custom collector turns the daemon's stats snapshot into metric families on each scrape, so the hot
paths keep their plain counters and pay nothing for the export; only request latency is observed per
request, into one histogram labelled by op.

``GET /lookup?model=M&tokens=1,2,3[&tp_rank=N]`` answers, as JSON, how many leading tokens of the
prompt each tier holds, keyed in the namespace of the connected engine of ``M`` (``tierkv lookup``
over HTTP); a bad query is a 400 with ``{"error": ...}``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import MetricsHandler
from prometheus_client.registry import Collector

from tierkv.core.errors import TierKVError
from tierkv.core.prefix import parse_token_ids
from tierkv.core.protocol import Op
from tierkv.daemon.control import Control
from tierkv.daemon.handlers import Served
from tierkv.daemon.sections import parse_addr

log = logging.getLogger("tierkv.daemon.metrics")

# (stats key, metric suffix, help) of each monotonic per-tier counter
_TIER_COUNTERS = (
    ("hits", "hits", "Blocks served from the tier."),
    ("misses", "misses", "Blocks asked of the tier and not found there."),
    ("bytes_in", "bytes_in", "Bytes written into the tier."),
    ("bytes_out", "bytes_out", "Bytes read out of the tier."),
    ("evictions", "evictions", "Blocks evicted from the tier."),
    ("demotions", "demotions", "Blocks moved from the tier to a colder one."),
    ("promotions", "promotions", "Blocks moved into the tier from a colder one."),
    ("corrupt", "corrupt_values", "Values that failed their checksum or header check (served as misses)."),
    ("foreign", "foreign_values", "Intact values of another namespace (other weights, adapter or layout) found "
     "under a key: served as misses and dropped."),
    ("earlier_format", "earlier_format_values", "Values an earlier tierkv wrote, dropped at start."),
    ("errors", "errors", "I/O or transport errors of the tier."),
    ("dropped_unwritten", "dropped_unwritten", "Blocks dropped before their write to a colder tier: a store "
     "needed room faster than the writer could clean blocks."),
    ("prefetches", "prefetches", "Blocks brought into the tier ahead of use for queued requests."),
)
_BREAKER_STATES = ("up", "read-only", "down")
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class StatsCollector(Collector):
    """Reads ``stats()`` of a running :class:`tierkv.daemon.server.Server` on each scrape."""

    def __init__(self, server: Served) -> None:
        self.server = server

    def describe(self) -> list[Metric]:
        return []  # no snapshot at registration: the store may not exist yet

    def collect(self) -> Iterator[Metric]:
        if self.server.store is None:
            return
        st = self.server.stats()
        yield from _tier_metrics(st["tiers"])
        yield from _link_metrics(st["transfer"], st["tiers"].get("remote"))
        yield from _daemon_metrics(st)
        yield from _namespace_metrics(st.get("namespaces", {}))
        yield from _tenant_metrics(st.get("tenants", {}))
        remote = st["tiers"].get("remote")
        if remote is not None:
            g = GaugeMetricFamily("tierkv_remote_breaker_state", "Remote tier circuit breaker: 1 for the "
                                  "current state.", labels=["state"])
            for state in _BREAKER_STATES:
                g.add_metric([state], 1.0 if remote.get("state") == state else 0.0)
            yield g


def _gauge(name: str, doc: str, value: float, unit: str = "") -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value, unit=unit)


def _tier_metrics(tiers: dict[str, dict]) -> Iterator[Metric]:
    gauges = {
        "capacity": GaugeMetricFamily("tierkv_tier_capacity_bytes", "Capacity of the tier.", labels=["tier"]),
        "used": GaugeMetricFamily("tierkv_tier_used_bytes", "Bytes the tier holds (slots or stored values).",
                                  labels=["tier"]),
        "blocks": GaugeMetricFamily("tierkv_tier_blocks", "Blocks held by the tier.", labels=["tier"]),
        "logical": GaugeMetricFamily("tierkv_tier_logical_bytes", "Uncompressed bytes of the blocks held.",
                                     labels=["tier"]),
        "ratio": GaugeMetricFamily("tierkv_tier_codec_ratio", "Logical over stored bytes (codec ratio).",
                                   labels=["tier"]),
    }
    counters = [(key, CounterMetricFamily(f"tierkv_tier_{suffix}", doc, labels=["tier"]))
                for key, suffix, doc in _TIER_COUNTERS]
    for name, d in tiers.items():
        gauges["capacity"].add_metric([name], d.get("capacity_bytes", 0))
        gauges["used"].add_metric([name], d.get("used_bytes", 0))
        gauges["blocks"].add_metric([name], d.get("blocks", 0))
        gauges["logical"].add_metric([name], d.get("bytes_logical", 0))
        stored = d.get("bytes_stored", 0)
        gauges["ratio"].add_metric([name], (d.get("bytes_logical", 0) / stored) if stored else 1.0)
        for key, fam in counters:
            fam.add_metric([name], d.get(key, 0))
    yield from gauges.values()
    for _, fam in counters:
        yield fam


def _link_metrics(transfer: dict, remote: dict | None) -> Iterator[Metric]:
    b = CounterMetricFamily("tierkv_link_bytes", "Bytes moved over a link between tiers.", labels=["link"])
    s = CounterMetricFamily("tierkv_link_seconds", "Seconds spent moving bytes over a link.", labels=["link"])
    for link, n in transfer.get("bytes", {}).items():
        b.add_metric([link], n)
    if remote is not None:
        b.add_metric(["host->remote"], remote.get("bytes_in", 0))
        b.add_metric(["remote->host"], remote.get("bytes_out", 0))
    for link, secs in transfer.get("seconds", {}).items():
        s.add_metric([link], secs)
    w = CounterMetricFamily("tierkv_link_wait_seconds", "Seconds transfers waited for a link's bandwidth "
                            "budget.", labels=["link"])
    for link, d in transfer.get("links", {}).items():
        w.add_metric([link], d.get("wait_s", 0.0))
    yield b
    yield s
    yield w
    yield _gauge("tierkv_transfers_inflight", "Transfers queued or running.", transfer.get("inflight", 0))


def _daemon_metrics(st: dict) -> Iterator[Metric]:
    yield _gauge("tierkv_clients", "Connected clients.", st["clients"])
    yield _gauge("tierkv_leases", "Blocks leased to clients (pinned until released).", st["leases"])
    yield CounterMetricFamily("tierkv_requests", "Requests served.", value=st["requests"])
    yield _gauge("tierkv_uptime_seconds", "Seconds since the daemon started.", st["uptime_s"])
    yield _gauge("tierkv_degraded", "1 while the daemon reports degraded health.",
                 1.0 if st["health"] != "ok" else 0.0)
    gate = st.get("store_gate") or {}
    for key, doc in (("offered", "Blocks engines offered for storing (new blocks of their requests)."),
                     ("stored", "Offered blocks the store gate said to store."),
                     ("skipped", "Offered blocks not stored: unlikely to be read back before they would leave."),
                     ("idle", "Of the skipped blocks, those an engine idle when their request ends stores."),
                     ("returns", "Offered blocks seen again (read back, or offered again).")):
        yield CounterMetricFamily(f"tierkv_store_gate_{key}_blocks", doc, value=gate.get(key, 0))
    li = st.get("lookup_index")
    if li:
        yield _gauge("tierkv_lookup_index_slots", "Slots of the shared lookup index.", li["slots"])
        yield _gauge("tierkv_lookup_index_keys", "Keys in the shared lookup index.", li["keys"])
        yield _gauge("tierkv_lookup_index_fill_ratio", "Keys over slots of the shared lookup index.",
                     li["keys"] / li["slots"] if li["slots"] else 0.0)
        yield _gauge("tierkv_lookup_index_overflow", "1 while the index is full (lookups use the socket).",
                     1.0 if li["overflow"] else 0.0)


def _namespace_metrics(namespaces: dict[str, dict]) -> Iterator[Metric]:
    blocks = GaugeMetricFamily("tierkv_namespace_blocks", "Blocks of a namespace (model, layout, rank).",
                               labels=["namespace", "model"])
    hits = CounterMetricFamily("tierkv_namespace_hits", "Blocks of a namespace served to fetches.",
                               labels=["namespace", "model"])
    misses = CounterMetricFamily("tierkv_namespace_misses", "Blocks of a namespace fetched and not cached.",
                                 labels=["namespace", "model"])
    for fp, d in namespaces.items():
        labels = [fp[:16], d["model"]]
        blocks.add_metric(labels, d["blocks"])
        hits.add_metric(labels, d.get("hits", 0))
        misses.add_metric(labels, d.get("misses", 0))
    yield blocks
    yield hits
    yield misses


def _tenant_metrics(tenants: dict[str, dict]) -> Iterator[Metric]:
    used = GaugeMetricFamily("tierkv_tenant_used_bytes", "Bytes a tenant's blocks take in a tier.",
                             labels=["tenant", "tier"])
    quota = GaugeMetricFamily("tierkv_tenant_quota_bytes", "A tenant's quota in a tier (absent: none).",
                              labels=["tenant", "tier"])
    hits = CounterMetricFamily("tierkv_tenant_hits", "A tenant's blocks served to fetches.", labels=["tenant"])
    misses = CounterMetricFamily("tierkv_tenant_misses", "Blocks a tenant's engine computed (offered for storing).",
                                 labels=["tenant"])
    for name, d in tenants.items():
        for tier, n in d["used"].items():
            used.add_metric([name, tier], n)
            if d["quota"].get(tier) is not None:
                quota.add_metric([name, tier], d["quota"][tier])
        hits.add_metric([name], d["hits"])
        misses.add_metric([name], d.get("misses", 0))
    yield used
    yield quota
    yield hits
    yield misses


class Metrics:
    """The registry of one daemon: its stats collector and the request latency histogram."""

    def __init__(self, server: Served, control: Control | None = None) -> None:
        """``control``: the :class:`~tierkv.daemon.control.Control` that answers ``/v1/...`` (None: 404)."""
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StatsCollector(server))
        self.latency = Histogram("tierkv_request_duration_seconds", "Time to serve a request, by op.",
                                 ["op"], registry=self.registry, buckets=LATENCY_BUCKETS)
        self._children: dict[int, Histogram] = {}
        self._http: ThreadingHTTPServer | None = None
        self._server = server
        self._control = control

    def observe(self, op: int, seconds: float) -> None:
        """Record one request's latency (called from the dispatch loop with the opcode)."""
        child = self._children.get(op)
        if child is None:
            try:
                name = Op(op).name.lower()
            except ValueError:
                name = "unknown"
            child = self._children[op] = self.latency.labels(op=name)
        child.observe(seconds)

    def serve(self, addr: str) -> tuple[str, int]:
        """Serve ``/metrics`` and ``/lookup`` on ``addr`` from a background thread; returns the bound
        (host, port)."""
        host, port = parse_addr(addr)
        try:
            self._http = ThreadingHTTPServer((host, port), _handler(self.registry, self._server, self._control))
        except OSError as exc:
            raise TierKVError(f"cannot serve metrics on {addr}: {exc.strerror or exc}") from None
        self._http.daemon_threads = True
        threading.Thread(target=self._http.serve_forever, name="tierkv-metrics", daemon=True).start()
        bound = str(self._http.server_address[0]), int(self._http.server_address[1])
        log.info("metrics on http://%s:%d/metrics", *bound)
        return bound

    def close(self) -> None:
        """Stop serving."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


def _handler(registry: CollectorRegistry, server: Served, control: Control | None) -> type:
    """The request handler: ``/lookup`` here, ``/v1/...`` the control API's, everything else
    Prometheus's exposition."""
    base = MetricsHandler.factory(registry)

    # A base class made at run time (prometheus_client types it as a plain ``type``): mypy cannot check it.
    class Handler(base):  # type: ignore[misc, valid-type]
        def do_GET(self) -> None:
            url = urlsplit(self.path)
            if url.path.startswith("/v1/"):
                return self._control("GET", url.path)
            if url.path != "/lookup":
                return super().do_GET()
            return self._reply(*_lookup(server, parse_qs(url.query)))

        def do_POST(self) -> None:
            self._control("POST", urlsplit(self.path).path)

        def _control(self, method: str, path: str) -> None:
            if control is None:
                return self._reply(404, {"error": "no control API on this endpoint"})
            n = int(self.headers.get("Content-Length") or 0)
            if not 0 <= n <= 64 << 20:
                return self._reply(413, {"error": "the body is larger than 64 MiB"})
            body = self.rfile.read(n) if n else b""
            return self._reply(*control.handle(method, path, self.headers.get("Authorization"), body))

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
            return None

    return Handler


def _lookup(server: Served, query: dict[str, list[str]]) -> tuple[int, dict]:
    """(HTTP status, JSON body) of ``/lookup``."""
    try:
        model = query.get("model", [""])[0]
        if not model:
            raise ValueError("model is required")
        rank = query.get("tp_rank", ["0"])[0]
        if not rank.isdigit():
            raise ValueError(f"tp_rank must be an int >= 0, got {rank!r}")
        tokens = parse_token_ids(query.get("tokens", [""])[0])
        store = server.store
        if store is None:
            return 503, {"error": "the daemon is starting"}
        identity = query.get("identity", [""])[0] or None
        return 200, store.fetch_path.lookup_tokens(model, int(rank), tokens, identity)
    except (ValueError, TierKVError) as exc:
        return 400, {"error": str(exc)}


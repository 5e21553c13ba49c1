"""A ring of periodic samples of the daemon's counters, behind ``tierkv stats --plot``.

Each sample reads plain counters of the block store (no walk over the blocks, no table lock), so taking
one costs microseconds whatever the daemon holds.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from tierkv.daemon.blockstore import BlockStore

log = logging.getLogger("tierkv.daemon.samples")


def take_sample(store: BlockStore) -> dict[str, object]:
    """One sample of a :class:`~tierkv.daemon.blockstore.BlockStore`: wall time, per tier used/capacity
    bytes and counters, bytes moved per link, and the blocks fetches got from any tier (``served``)."""
    tiers: dict[str, dict[str, int]] = {}
    for name, counters, used, capacity in store.snapshots.tier_figures():
        tiers[name] = {"used": int(used), "capacity": int(capacity), "hits": int(counters.hits),
                       "misses": int(counters.misses), "bytes_in": int(counters.bytes_in),
                       "bytes_out": int(counters.bytes_out), "evictions": int(counters.evictions)}
    links = {k: int(v) for k, v in dict(store.engine.book.link_bytes).items()}
    if store.remote is not None:
        links["host->remote"] = int(store.m.remote.stats.bytes_in)
        links["remote->host"] = int(store.m.remote.stats.bytes_out)
    fetched = [list(c) for c in list(store.table.ns_hits.values())]  # a copy: HELLOs may add namespaces meanwhile
    served = {"hits": sum(c[0] for c in fetched), "misses": sum(c[1] for c in fetched)}
    return {"t": round(time.time(), 3), "tiers": tiers, "links": links, "served": served}


class SampleRing:
    """The newest ``count`` samples, one every ``interval`` seconds, taken on a daemon thread."""

    def __init__(self, store: BlockStore, interval: float, count: int) -> None:
        self.store = store
        self.interval = interval
        self._ring: collections.deque[dict[str, object]] = collections.deque(maxlen=count)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start sampling (no-op when the interval is 0)."""
        if self.interval <= 0 or self._thread is not None:
            return
        self._ring.append(take_sample(self.store))
        self._thread = threading.Thread(target=self._run, name="tierkv-samples", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._ring.append(take_sample(self.store))
            except Exception as exc:  # e.g. a tier closing under us at shutdown: skip this sample
                log.debug("sample skipped: %s", exc)

    def stop(self) -> None:
        """Stop the sampling thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None

    def snapshot(self) -> dict[str, object]:
        """``{"interval_s", "samples": [oldest .. newest]}``."""
        return {"interval_s": self.interval, "samples": list(self._ring)}

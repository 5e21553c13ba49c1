"""The connector's counters in vLLM's stats: its periodic log line and its Prometheus ``/metrics``
(``vllm:tierkv_*``, one series per engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from tierkv.integrations.vllm.transfer import Counters

__all__ = ["TierKVConnectorStats", "TierKVPromMetrics"]

# counter field -> (Prometheus name, help)
_PROM = {
    "hit_tokens": ("vllm:tierkv_hit_tokens", "Prompt tokens whose KV tierkv served into vLLM."),
    "stored_tokens": ("vllm:tierkv_stored_tokens", "Tokens whose KV vLLM handed to tierkv."),
    "new_blocks": ("vllm:tierkv_new_blocks", "Blocks stored that tierkv did not hold yet."),
    "load_s": ("vllm:tierkv_load_seconds", "Seconds spent loading KV from tierkv inside steps."),
    "load_steps": ("vllm:tierkv_load_steps", "Steps that loaded KV from tierkv inside the step."),
    "store_s": ("vllm:tierkv_store_seconds", "Seconds spent storing KV into tierkv."),
    "store_copy_s": ("vllm:tierkv_store_copy_seconds",
                     "Of the store seconds, those spent copying vLLM's pages into tierkv's slots."),
    "load_errors": ("vllm:tierkv_load_errors", "Blocks that could not be loaded (vLLM recomputed them)."),
    "store_errors": ("vllm:tierkv_store_errors", "Blocks that could not be stored (daemon absent or failing)."),
    "store_skipped": ("vllm:tierkv_store_skipped", "Blocks not stored: the host tier had no room to spare at once."),
    "store_deduplicated": ("vllm:tierkv_store_deduplicated",
                           "Blocks not stored because tierkv held them already (not copied; counted as uses)."),
    "store_steps": ("vllm:tierkv_store_steps", "Steps whose store pass stored blocks."),
    "async_loads": ("vllm:tierkv_async_loads", "Requests whose prefix loaded beside the forward pass."),
    "async_hit_tokens": ("vllm:tierkv_async_hit_tokens", "Prompt tokens served by asynchronous loads."),
    "async_wait_s": ("vllm:tierkv_async_wait_seconds", "Seconds asynchronous loads took, summed."),
    "load_bytes": ("vllm:tierkv_load_bytes", "Bytes copied from tierkv into vLLM's pages."),
    "window_saved_bytes": ("vllm:tierkv_window_saved_bytes",
                           "Bytes of served blocks outside a sliding window: never moved."),
    "store_offered": ("vllm:tierkv_store_offered", "New blocks offered to tierkv's store gate."),
    "store_gated": ("vllm:tierkv_store_gated", "New blocks not stored: unlikely to be read back (store gate)."),
    "store_idle": ("vllm:tierkv_store_idle",
                   "Of the gated blocks, those stored after their request ended while the engine was idle."),
    "unidentified_requests": ("vllm:tierkv_unidentified_requests",
                              "Requests neither stored nor loaded: an input (adapter, image) could not be identified."),
}


@dataclass
class TierKVConnectorStats(KVConnectorStats):
    """The workers' :class:`~tierkv.integrations.vllm.transfer.Counters`, summed."""

    def _counters(self) -> Counters:
        c = Counters()
        c.add(self.data)
        return c

    def reset(self) -> None:
        """Start from zero."""
        self.data = Counters().as_dict()

    def aggregate(self, other: KVConnectorStats) -> TierKVConnectorStats:
        """Add another interval's or worker's counters."""
        c = self._counters()
        c.add(other.data)
        self.data = c.as_dict()
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's totals, as vLLM's log line shows them."""
        c = self._counters()
        per_step = c.store_s / c.store_steps if c.store_steps else 0.0
        return {"hit_tokens": c.hit_tokens, "async_hit_tokens": c.async_hit_tokens,
                "stored_tokens": c.stored_tokens, "load_ms": round(c.load_s * 1e3, 1),
                "load_max_ms": round(c.load_max_s * 1e3, 1),
                "store_ms": round(c.store_s * 1e3, 1), "store_ms_per_step": round(per_step * 1e3, 2),
                "store_max_ms": round(c.store_max_s * 1e3, 1), "load_errors": c.load_errors,
                "store_errors": c.store_errors, "store_skipped": c.store_skipped,
                "store_deduplicated": c.store_deduplicated,
                "load_mib": round(c.load_bytes / (1 << 20), 1),
                "window_saved_mib": round(c.window_saved_bytes / (1 << 20), 1),
                "unidentified_requests": c.unidentified_requests, "store_offered": c.store_offered,
                "store_gated": c.store_gated, "store_idle": c.store_idle}

    def is_empty(self) -> bool:
        """Nothing happened in the interval."""
        return not any(self.data.get(k) for k in _PROM)


class TierKVPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters fed from :class:`TierKVConnectorStats`."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            field: create_metric_per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                                            per_engine_labelvalues)
            for field, (name, doc) in _PROM.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one interval's counters."""
        for field, per_engine in self._counters.items():
            value = transfer_stats_data.get(field, 0)
            if value:
                # vLLM's create_metric_per_engine returns any metric type; these are counters.
                per_engine[engine_idx].inc(value)  # type: ignore[union-attr]

"""``TierKVConnector``: tierkv as vLLM's KV cache, through vLLM's KV connector API (v1).

Load it with::

    --kv-transfer-config '{"kv_connector": "TierKVConnector",
        "kv_connector_module_path": "tierkv.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"socket": "/path/tierkv.sock"}}'

``kv_connector_extra_config`` keys: ``socket`` (the daemon's socket; default the client's default),
``model_id`` (the namespace's readable label; default the model directory's name or the hub id),
``sync_load_max_mib`` (a cached prefix in host memory up to this size is copied inside the step, a
longer one beside it, as a prefix on disk is; default: no limit), ``identity`` (``sampled`` or ``full``:
how the weights are digested) and ``identity_override`` (see
:mod:`~tierkv.integrations.vllm.inputs`: blocks are keyed by the model's identity, not its label).

``kv_role`` (:class:`~tierkv.integrations.vllm.role.Role`): ``kv_both`` loads and stores, committing
behind the step; ``kv_producer`` (a prefill instance) stores every full block of the prompt, vLLM's
own prefix hits included, and commits them within the step, so they are in tierkv when the response
leaves (and, where the daemon has a remote tier, written through to it: a consumer on another node whose
daemon shares that tier finds them); ``kv_consumer`` (a decode instance) only loads. Every role is a best-effort cache
(``requires_kv_delivery`` is False): a block that did not arrive is recomputed.

Each of vLLM's KV cache groups (full attention, sliding window, MLA) has a namespace of its own, laid
out by its spec (:mod:`~tierkv.integrations.vllm.groups`): a block position counts as cached when every
group that needs it holds it, a sliding-window group loads only the blocks its window reaches, and a
model with several groups or a window loads beside the step, failing a load per request
(:mod:`~tierkv.integrations.vllm.grouped`).

The scheduler side (:class:`~tierkv.integrations.vllm.plan.Planner`) finds each request's cached
prefix in the shared lookup index (with tensor parallelism, in every rank's namespace: a block counts as
cached, and as in host memory, only where every rank holds it), starts promoting the disk blocks of requests as they enter the
queue, and plans the loads and one store pass per step; the worker side
(:class:`~tierkv.integrations.vllm.transfer.Transfers`) runs them against vLLM's pages. A prefix in
host memory loads inside the step; one partly on disk loads beside it (vLLM parks the request until
:meth:`TierKVConnector.get_finished` reports it). A block that cannot be loaded is recomputed by vLLM
(the connector sets ``kv_load_failure_policy`` to ``recompute``); with the daemon absent, vLLM serves
as if the connector were not there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from tierkv.core.keys import Namespace
from tierkv.integrations.vllm.committer import StoreCommitter
from tierkv.integrations.vllm.grouped import GroupTransfers
from tierkv.integrations.vllm.groups import GroupSpec, group_specs, namespace_model
from tierkv.integrations.vllm.inputs import (
    AdapterIdentities,
    IdentityUnknown,
    engine_identity,
    request_inputs,
)
from tierkv.integrations.vllm.link import Link
from tierkv.integrations.vllm.pages import VllmPages, cpu_layout_ok
from tierkv.integrations.vllm.plan import BlockIO, PlanGroup, Planner, PrefillMeter
from tierkv.integrations.vllm.role import Role
from tierkv.integrations.vllm.stats import TierKVConnectorStats, TierKVPromMetrics
from tierkv.integrations.vllm.transfer import Transfers

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("vllm.tierkv")

__all__ = ["TierKVConnector", "TierKVConnectorMetadata"]


@dataclass
class TierKVConnectorMetadata(KVConnectorMetadata):
    """One step's loads (before the forward pass) and stores (after it); ``release``: finished requests
    whose pages vLLM keeps for this step's stores (reported as sent once they ran)."""

    loads: list[BlockIO] = field(default_factory=list)
    stores: list[BlockIO] = field(default_factory=list)
    release: list[str] = field(default_factory=list)


def _model_id(vllm_config: VllmConfig, extra: dict[str, Any]) -> str:
    if extra.get("model_id"):
        return str(extra["model_id"])
    model = str(vllm_config.model_config.model)
    path = Path(model)
    return path.name if path.is_dir() else model


def _sync_load_blocks(extra: dict[str, Any], block_bytes: int) -> int | None:
    """The most blocks a prefix in host memory copies inside the step (``sync_load_max_mib``; absent or
    None: no limit)."""
    mib = extra.get("sync_load_max_mib")
    if mib is None:
        return None
    if isinstance(mib, bool) or not isinstance(mib, int | float) or not mib >= 0:
        raise ValueError(f"kv_connector_extra_config sync_load_max_mib must be a number >= 0, got {mib!r}")
    return int(mib * 2**20) // block_bytes


class TierKVConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector backed by a tierkv daemon (both roles: scheduler and worker).

    Each KV cache group (full attention, sliding window, MLA) is stored in a namespace of its own
    (:mod:`~tierkv.integrations.vllm.groups`); a model with a group tierkv cannot serve (Mamba, linear
    attention, packed or quantized-with-scales pages) leaves the connector disabled with one log line, and
    vLLM runs as without it.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None  # the base class raised otherwise
        if ktc.kv_load_failure_policy != "recompute":
            # A block lost between lookup and load must cost a recompute, never the request.
            ktc.kv_load_failure_policy = "recompute"
        extra = dict(ktc.kv_connector_extra_config or {})
        self._kv_role = Role.of(ktc.kv_role)  # the base class's _role is vLLM's KVConnectorRole
        cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
        self._write_dtypes = (getattr(vllm_config.model_config, "dtype", None), cache_dtype)  # the CPU page check
        self._groups, why = group_specs(kv_cache_config, cache_dtype)
        self._whole_requests = len(self._groups) > 1 or any(g.reach is not None for g in self._groups)
        if self._whole_requests and not hasattr(KVConnectorBase_V1, "get_transfer_results"):
            self._groups, why = [], "this vLLM cannot take a failed load per request (hybrid or sliding-window model)"
        identity = ""
        if self._groups:
            try:
                identity = engine_identity(vllm_config, extra)
            except IdentityUnknown as exc:
                self._groups, why = [], f"cannot identify the model's weights ({exc}); set identity_override " \
                                        "in kv_connector_extra_config to serve them anyway"
        if not self._groups:
            log.warning("tierkv: connector disabled: %s", why)
        par = vllm_config.parallel_config
        self._tp_size = int(par.tensor_parallel_size)
        self._socket = extra.get("socket") or None
        self._model = _model_id(vllm_config, extra)
        self._models = namespace_model(self._model, self._groups)
        self._identities = namespace_model(identity, self._groups) if identity else [""] * len(self._groups)
        self._reported: dict[str, int] = {}  # the scheduler's counters, as last reported
        self._planner: Planner | None = None
        self._meter: PrefillMeter | None = None
        self._transfers: GroupTransfers | None = None
        if role == KVConnectorRole.SCHEDULER and self._groups:
            layout = self._groups[0].layout
            groups = [self._plan_group(i) for i in range(len(self._groups))]
            link = groups[0].link
            self._meter = PrefillMeter(lambda tokens, seconds: link.call(
                lambda c: c.report_recompute(tokens, seconds)))
            adapters, bt = AdapterIdentities(), layout.block_tokens
            self._planner = Planner(groups, bt, stores=self._kv_role.stores,
                                    sync_load_blocks=_sync_load_blocks(extra, layout.block_bytes), meter=self._meter,
                                    identify=lambda request: request_inputs(request, bt, adapters),
                                    gate=self._kv_role.stores and not self._kv_role.commit_in_step)
            log.info("tierkv: serving %s (identity %s)", "; ".join(_describe(g, m) for g, m in
                                                                   zip(self._groups, self._models)), identity[:16])

    def _plan_group(self, i: int) -> PlanGroup:
        """Group ``i`` as the scheduler sees it: a connection to every tensor-parallel rank's namespace."""
        g, model, identity = self._groups[i], self._models[i], self._identities[i]
        links = [Link(self._socket, model=model, layout=g.layout, tp_rank=r, tp_size=self._tp_size,
                      identity=identity, announce=i == 0 and r == 0) for r in range(self._tp_size)]
        return PlanGroup(links[0], Namespace(model, g.layout, 0, self._tp_size, identity=identity), g,
                         tuple(links[1:]))

    # ---- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map vLLM's per-layer caches, group by group; checks their layout before any block is shared."""
        if not self._groups:
            return
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank() if self._tp_size > 1 else 0
        parts = []
        for g, model, identity in zip(self._groups, self._models, self._identities):
            pages = _pages(g, kv_caches, *self._write_dtypes)
            if pages is None:
                return
            args: dict[str, Any] = dict(model=model, layout=g.layout, tp_rank=rank, tp_size=self._tp_size,
                                        identity=identity, announce=False)  # the scheduler side says when the daemon goes and comes back
            # three connections: in-step loads (and a producer's stores), loads beside the step, and stores
            # committed behind the step (their slots and commits)
            behind = self._kv_role.stores and not self._kv_role.commit_in_step
            parts.append(Transfers(
                Link(self._socket, **args), pages, async_link=Link(self._socket, **args),
                committer=StoreCommitter(Link(self._socket, **args), g.layout.block_tokens)
                if behind else None, remote=self._kv_role.write_through))
        self._transfers = GroupTransfers(parts, self._whole_requests)
        self._transfers.connect()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Load this step's in-host blocks into vLLM's pages (all requests, all layers, one pass) and
        start the asynchronous loads of prefixes partly on disk."""
        meta = self._get_connector_metadata()
        if self._transfers is not None and isinstance(meta, TierKVConnectorMetadata):
            self._transfers.load([io for io in meta.loads if io.wait_s is None])
            self._transfers.start_async([io for io in meta.loads if io.wait_s is not None])

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose pages this step's stores copied (vLLM frees them now), and requests
        whose asynchronous loads finished (their missing blocks are reported as load errors in the same
        step). vLLM asks :meth:`get_transfer_results`, which also names the requests whose load failed."""
        released = self._released()
        if self._transfers is None:
            return released or None, None
        return released or None, self._transfers.take_done() or None

    def _released(self) -> set[str]:
        """The finished requests this step's stores read from (the stores ran in :meth:`wait_for_save`)."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        return set(meta.release) if isinstance(meta, TierKVConnectorMetadata) else set()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """As :meth:`get_finished`, plus the requests whose load failed as a whole (hybrid and sliding-window
        models: vLLM recomputes them)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        released = self._released()
        if self._transfers is None:
            return KVConnectorTransferResults(finished_sending=released)
        done = self._transfers.take_done()
        return KVConnectorTransferResults(finished_sending=released, finished_recving=done,
                                          failed_recving=self._transfers.take_failed())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in :meth:`start_load_kv`: nothing to wait for per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Stores run once per step in :meth:`wait_for_save`, after every layer is written."""

    def wait_for_save(self) -> None:
        """Store the step's new full blocks (all requests, all layers, one pass)."""
        meta = self._get_connector_metadata()
        if self._transfers is not None and isinstance(meta, TierKVConnectorMetadata):
            self._transfers.store(meta.stores)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks vLLM must recompute: missing, evicted or unreadable when their load ran."""
        return set() if self._transfers is None else self._transfers.take_load_errors()

    def get_kv_connector_stats(self) -> TierKVConnectorStats | None:
        """Counters since the last call (tokens served and stored, times, errors; the scheduler's:
        blocks offered to the store gate and skipped by it, and requests neither stored nor loaded
        because an input could not be identified)."""
        if self._transfers is not None:
            return TierKVConnectorStats(data=self._transfers.take_counters().as_dict())
        if self._planner is None:
            return None
        p, o = self._planner, self._planner.offers
        now = {"unidentified_requests": p.unidentified, "store_offered": o.offered if o else 0,
               "store_gated": o.gated if o else 0, "store_idle": p.idle.stored}
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        return TierKVConnectorStats(data=delta) if any(delta.values()) else None

    def shutdown(self) -> None:
        """Close the connections to the daemon."""
        if self._planner is not None:
            for group in self._planner.groups:
                for link in group.links:
                    link.close()
        if self._transfers is not None:
            self._transfers.close()

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache in every role: a store that did not land is a later miss, never a
        request that must be recomputed because its hand-off was lost."""
        return False

    # ---- scheduler side ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens tierkv can load beyond vLLM's own prefix hit, and whether they load asynchronously
        (part of the prefix is not in host memory)."""
        if self._planner is None:
            return 0, False
        return self._planner.matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Any) -> None:
        """A request entered the queue: the daemon starts promoting its cached prefix's disk blocks."""
        if self._planner is not None:
            self._planner.queued(request)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """Learn vLLM's null block (it stands for a sliding window's blocks outside the window) and how
        full its KV cache is (finished requests' pages are held for an idle step only while it has room)."""
        if self._planner is None:
            return
        null = getattr(getattr(gpu_block_pool, "null_block", None), "block_id", None)
        if isinstance(null, int):
            self._planner.null_block = null
        self._planner.idle.usage = gpu_block_pool.get_usage

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Remember the request's blocks (every group's) and plan the load of its external tokens."""
        if self._planner is not None:
            self._planner.allocated(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads and stores for the workers."""
        if self._planner is None:
            return TierKVConnectorMetadata()
        if self._meter is not None:
            self._meter.step(scheduler_output.num_scheduled_tokens)
        plan = self._planner.step(scheduler_output)
        return TierKVConnectorMetadata(loads=plan.loads, stores=plan.stores, release=plan.release)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request and tell the daemon its blocks are a conversation tail; they were stored as
        they filled, so vLLM may free them now, unless a later step with no request to run stores the
        run the store gate kept for an idle engine (vLLM frees them once the worker reports it)."""
        if self._planner is None:
            return False, None
        self._planner.finished(request)
        return self._planner.holds(request.request_id), None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """As :meth:`request_finished`, for a model with several KV cache groups."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TierKVConnectorStats | None:
        """vLLM's logger rebuilds the workers' counters with this."""
        return TierKVConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> TierKVPromMetrics:
        """The connector's counters as Prometheus metrics on vLLM's own /metrics."""
        return TierKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _describe(g: GroupSpec, model: str) -> str:
    lo = g.layout
    what = f"{lo.num_layers} layers of a {lo.head_dim}-wide latent" if lo.kind == "latent" else \
        f"{lo.num_layers} layers x {lo.num_kv_heads} KV heads x {lo.head_dim}"
    window = f", window {g.window}" if g.window else ""
    return f"group {g.index} ({g.kind}{window}: {what}, {lo.dtype}) as {model!r}"


def _pages(g: GroupSpec, kv_caches: dict[str, torch.Tensor], model_dtype: Any = None,
           cache_dtype: str = "auto") -> VllmPages | None:
    """Group ``g``'s pages, checked against its spec (and, on the CPU, vLLM's own cache-write kernel)."""
    try:
        pages = VllmPages([kv_caches[n] for n in g.layer_names], g.layout.head_dim, kind=g.layout.kind,
                          dtype=g.layout.dtype)
    except (KeyError, ValueError) as exc:
        log.warning("tierkv: connector disabled: cannot use vLLM's KV caches of group %d (%s)", g.index, exc)
        return None
    if pages.layout != g.layout:
        log.warning("tierkv: connector disabled: group %d's caches are %s, its KV spec says %s", g.index,
                    pages.layout, g.layout)
        return None
    if pages.device.type == "cpu" and g.layout.kind == "kv" and not _cpu_pages_ok(pages, model_dtype, cache_dtype):
        return None
    return pages


def _cpu_pages_ok(pages: VllmPages, model_dtype: Any = None, cache_dtype: str = "auto") -> bool:
    """Check the CPU page layout against vLLM's own cache-write kernel (a scratch block); an fp8 cache is
    written from the model's dtype, as vLLM's attention layer writes it."""
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        lo = pages.layout
        src = model_dtype if lo.dtype.startswith("float8") and isinstance(model_dtype, torch.dtype) else lo.torch_dtype
        isa = _get_attn_isa(src, lo.block_tokens, lo.head_dim)
        ok = cpu_layout_ok(pages, ops.cpu_attn_reshape_and_cache, isa, src, cache_dtype)
    except Exception as exc:  # noqa: BLE001 - an unknown vLLM build: refuse rather than guess
        log.warning("tierkv: connector disabled: cannot check vLLM's CPU page layout (%s)", exc)
        return False
    if not ok:
        log.warning("tierkv: connector disabled: vLLM's CPU pages are not laid out as K^T then V per head")
    return ok

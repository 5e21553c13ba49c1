"""Attention mass per key token, from forward hooks on a model's eager attention."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)


class AttentionProbe:
    """Per-layer forward hooks that reduce eager attention weights to attention mass per key token.

    Each hook sums its layer's weights ``[batch, heads, queries, keys]`` over heads and queries into
    one running vector as the layer runs, so no more than one layer's weights exist at a time.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        # transformers' attention modules carry their layer index and return (output, weights).
        self.modules = [m for m in model.modules()
                        if hasattr(m, "layer_idx") and "attention" in type(m).__name__.lower()]
        self.mass: torch.Tensor | None = None
        self.rows = 0.0  # softmax rows summed (each sums to 1), for normalising
        self.disabled = False  # set when the model refused eager attention

    @property
    def usable(self) -> bool:
        """Whether attention weights can be had: attention modules were found, and the model runs
        eager attention or can switch to it."""
        eager = getattr(self.model.config, "_attn_implementation", None) == "eager"
        return (bool(self.modules) and not self.disabled
                and (eager or hasattr(self.model, "set_attn_implementation")))

    def _hook(self, module: Any, args: Any, output: Any) -> None:
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if weights is None:
            return
        w = weights[0]  # [heads, queries, keys]
        reduced = w.sum(dim=(0, 1), dtype=torch.float32)
        if self.mass is None:
            self.mass = reduced
        else:
            n = min(self.mass.shape[0], reduced.shape[0])
            self.mass[:n] += reduced[:n]
        self.rows += float(w.shape[0] * w.shape[1])

    def run(self, step: Callable[[], Any]) -> Any:
        """Run ``step()`` with eager attention and the hooks on; the reduced mass is in ``self.mass``."""
        self.mass, self.rows = None, 0.0
        cfg = self.model.config
        before = getattr(cfg, "_attn_implementation", None)
        switch = before is not None and before != "eager"
        if switch:  # sdpa/flash kernels never form the weights; eager does, for this one step
            try:
                self.model.set_attn_implementation("eager")
            except (ValueError, ImportError, NotImplementedError) as exc:
                log.warning("no attention mass from this model (eager attention unavailable: %s)", exc)
                self.disabled = True
                return step()
        handles = [m.register_forward_hook(self._hook) for m in self.modules]
        try:
            return step()
        finally:
            for h in handles:
                h.remove()
            if switch:
                self.model.set_attn_implementation(before)

    def block_scores(self, n_blocks: int, block_tokens: int) -> list[float]:
        """Mass of the first ``n_blocks`` full blocks relative to a uniform spread (1.0 = uniform)."""
        if self.mass is None or self.rows == 0 or n_blocks == 0:
            return []
        kv = self.mass.shape[0]
        per_block = self.mass[:n_blocks * block_tokens].reshape(n_blocks, block_tokens).sum(dim=1)
        uniform = self.rows * block_tokens / kv
        return [float(x) for x in (per_block / uniform)]

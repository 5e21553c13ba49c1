"""A transformers causal LM attached to tierkv: prefix KV loaded from the tiers, new blocks stored."""

from __future__ import annotations

import functools
import logging
import math
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from tierkv.core.errors import TierKVError
from tierkv.core.layout import Layout, dtype_name
from tierkv.integrations.transformers.cache import (
    DEFAULT_BLOCK_TOKENS,
    Forward,
    eos_ids,
    layer_kv,
    model_layout,
    new_cache,
    set_layer,
)
from tierkv.integrations.transformers.generation import Generation, GenerationStats, check_prompt, greedy
from tierkv.integrations.transformers.probe import AttentionProbe

log = logging.getLogger(__name__)


class AttachedLM:
    """A transformers causal LM whose prefix KV is served and stored by tierkv.

    Args:
        model: a transformers causal LM (eval mode) using the standard ``DynamicCache``.
        client: a connected :class:`tierkv.Client` whose layout matches :func:`model_layout` of
            this model (see :func:`attach`).
        store_generated: also store blocks filled by generated tokens (a next chat turn that
            repeats the reply reuses them).
        touch_every: report attention mass every this many decode steps (0: never). The first
            decode step is always sampled.
        owns_client: close the client on :meth:`close`.
    """

    def __init__(self, model: Any, client: Any, *, store_generated: bool = True, touch_every: int = 16,
                 owns_client: bool = False) -> None:
        if touch_every < 0:
            raise ValueError("touch_every must be >= 0")
        self.model = model
        self.client = client
        layout = getattr(client, "layout", None)
        self.layout: Layout = layout if layout is not None else model_layout(model)
        geom = model_layout(model, self.layout.block_tokens, self.layout.dtype)
        if geom != self.layout:
            raise ValueError(f"client layout {self.layout} does not fit the model ({geom})")
        self.block_tokens = self.layout.block_tokens
        self.store_generated = store_generated
        self.touch_every = touch_every
        self.owns_client = owns_client
        self._fwd = Forward(model)
        self._probe = AttentionProbe(model)
        param = next(model.parameters())
        self._model_dtype, self._device = param.dtype, param.device

    def close(self) -> None:
        """Close the client if this object opened it."""
        if self.owns_client:
            self.client.close()

    def __enter__(self) -> AttachedLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- load ----------------------------------------------------------------------------------

    def _load_prefix(self, ids: list[int], keys: list[bytes], st: GenerationStats) -> tuple[Any, int, int]:
        """Build a cache from the longest cached prefix. Returns (cache, tokens loaded, blocks held)."""
        cache = new_cache(self.model)
        if not keys:
            return cache, 0, 0
        try:
            hit = len(self.client.lookup_tiers(keys))
            if hit == 0:
                return cache, 0, 0
            with self.client.acquire(keys[:hit]) as lease:
                n = int(lease.count)
                # Keep at least the last prompt token to run: its logits give the first new token.
                use = min(n * self.block_tokens, len(ids) - 1)
                nb = math.ceil(use / self.block_tokens)
                if use > 0:
                    self._fill(cache, lease.views[:nb], use)
                    st.cached_blocks_by_tier = dict(Counter(str(t) for t in list(lease.tiers)[:nb]))
        except TierKVError as exc:  # tierkv down or full: serve the request by recompute
            log.warning("tierkv load failed, recomputing: %s", exc)
            st.errors += 1
            return new_cache(self.model), 0, 0
        return cache, use, n

    def _fill(self, cache: Any, views: Sequence[torch.Tensor], tokens: int) -> None:
        """Copy ``tokens`` tokens from block views [2, L, H, T, D] into ``cache``: per layer and
        K/V one gather over the blocks (views are separate slots, not one tensor)."""
        dtype, device = self._model_dtype, self._device
        for layer in range(self.layout.num_layers):
            kv = []
            for which in (0, 1):
                t = torch.cat([v[which, layer] for v in views], dim=1)[:, :tokens]  # [H, tokens, D]
                kv.append(t.to(device=device, dtype=dtype)[None])
            set_layer(cache, layer, kv[0], kv[1])

    # -- store ---------------------------------------------------------------------------------

    def _store(self, cache: Any, keys: Sequence[bytes], first_block: int, st: GenerationStats,
               parent: bytes | None) -> int:
        """Write blocks ``first_block .. first_block + len(keys)`` of ``cache`` into new slots and
        commit them (a chain continuing ``parent``); returns blocks committed (0 on failure)."""
        m = len(keys)
        if m == 0:
            return 0
        t0 = time.perf_counter()
        T = self.block_tokens
        a, b = first_block * T, (first_block + m) * T
        try:
            with self.client.alloc(m) as slots:  # slots left uncommitted by an error are given back
                for which in (0, 1):
                    # One gather of the new tokens across layers: [L, H, m*T, D].
                    src = torch.stack([layer_kv(cache, layer)[which][0, :, a:b]
                                       for layer in range(self.layout.num_layers)])
                    for i in range(m):
                        slots.views[i][which].copy_(src[:, :, i * T:(i + 1) * T])
                self.client.commit(list(keys), slots, chains=[(0, parent)])
        except TierKVError as exc:
            log.warning("tierkv store failed, going on without it: %s", exc)
            st.errors += 1
            return 0
        finally:
            st.store_s += time.perf_counter() - t0
        st.stored_blocks += m
        return m

    # -- touch ---------------------------------------------------------------------------------

    def _touch(self, keys: Sequence[bytes], st: GenerationStats) -> None:
        scores = self._probe.block_scores(len(keys), self.block_tokens)
        if not scores:
            return
        try:
            self.client.touch(list(keys[:len(scores)]), scores)
            st.touches += 1
        except TierKVError as exc:
            log.warning("tierkv touch failed: %s", exc)
            st.errors += 1

    # -- generation ----------------------------------------------------------------------------

    def stream(self, prompt_ids: Sequence[int], max_new_tokens: int = 32,
               eos_token_id: int | Sequence[int] | None = None) -> Generation:
        """Greedy generation with prefix KV from tierkv; iterate the result for token ids.

        Args:
            prompt_ids: the whole prompt (for chat: the whole conversation so far).
            max_new_tokens: tokens to generate at most.
            eos_token_id: stop ids (default the model's); the stop token is yielded.
        """
        ids = check_prompt(prompt_ids, max_new_tokens)
        stops = eos_ids(self.model, eos_token_id)
        return Generation(lambda gen: self._run(gen, ids, max_new_tokens, stops), len(ids))

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int = 32,
                 eos_token_id: int | Sequence[int] | None = None) -> Generation:
        """:meth:`stream`, run to the end."""
        gen = self.stream(prompt_ids, max_new_tokens, eos_token_id)
        gen.run()
        return gen

    def _run(self, gen: Generation, ids: list[int], max_new_tokens: int, stops: set[int]) -> Iterator[int]:
        st, T = gen.stats, self.block_tokens
        t0 = time.perf_counter()
        keys = self.client.block_keys(ids)
        cache, use, held = self._load_prefix(ids, keys, st)
        st.cached_tokens = use
        st.load_s = time.perf_counter() - t0
        logits, cache = self._fwd(torch.tensor([ids[use:]], dtype=torch.long, device=self._device), cache)
        token = greedy(logits)
        st.computed_tokens = len(ids) - use
        st.ttft_s = time.perf_counter() - t0
        st.prefill_s = st.ttft_s - st.load_s
        yield token

        t1 = time.perf_counter()
        # Blocks known to be in tierkv, in order: the leased prefix, then what this request commits.
        stored = list(keys[:held])
        if len(keys) > held:
            done = self._store(cache, keys[held:], held, st, keys[held - 1] if held else None)
            stored += keys[held:held + done]
        seq = list(ids)
        for step in range(max_new_tokens - 1):
            if token in stops:
                break
            seq.append(token)
            x = torch.tensor([[token]], dtype=torch.long, device=self._device)
            sampled = self.touch_every > 0 and step % self.touch_every == 0 and self._probe.usable
            if sampled:
                logits, cache = self._probe.run(functools.partial(self._fwd, x, cache))
                self._touch(stored, st)
            else:
                logits, cache = self._fwd(x, cache)
            token = greedy(logits)
            # The cache now holds len(seq) tokens: commit a block the moment it is full.
            if self.store_generated and len(seq) % T == 0 and len(stored) == len(seq) // T - 1:
                parent = stored[-1] if stored else None
                new = self.client.block_keys(seq[-T:], parent=parent)
                if self._store(cache, new, len(stored), st, parent):
                    stored += new
            st.decode_s = time.perf_counter() - t1
            yield token


def attach(model: Any, socket: str | None = None, *, model_id: str | None = None,
           block_tokens: int = DEFAULT_BLOCK_TOKENS, store_dtype: Any = None, identity: str | None = None,
           **kwargs: Any) -> AttachedLM:
    """Connect to a tierkv daemon with ``model``'s layout and return the attached model.

    Args:
        model: a transformers causal LM.
        socket: daemon socket path (``None``: the default path).
        model_id: the namespace's readable label (default the config's ``_name_or_path``).
        identity: the model's identity (None: taken from its loaded weights, an adapter's included, its
            config and dtype, as :func:`~tierkv.client.identity.model_identity` does; blocks are shared
            with every engine of the same identity).
        block_tokens: tokens per block.
        store_dtype: stored dtype; default the model's cache dtype (exact warm runs). ``"bfloat16"``
            or ``"float16"`` halve the bytes of a float32 model.
        **kwargs: passed to :class:`AttachedLM`.
    """
    from tierkv.client.client import Client

    layout = model_layout(model, block_tokens, dtype_name(store_dtype) if store_dtype is not None else None)
    name = model_id or str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
    if identity is None:
        from tierkv.client.identity import model_identity, tensors_digest

        identity = model_identity(weights=tensors_digest(model.state_dict()), config=model.config.to_dict(),
                                  dtype=str(getattr(model, "dtype", "")), kv_cache_dtype=layout.dtype)
    client = Client.connect(socket, model=name, layout=layout, identity=identity)
    return AttachedLM(model, client, owns_client=True, **kwargs)

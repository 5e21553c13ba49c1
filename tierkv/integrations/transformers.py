"""Attach a transformers causal LM to tierkv: prefix KV comes back from the tiers, new blocks go in.

Works with any causal LM whose cache is transformers' standard ``DynamicCache`` of full-attention
layers (keys and values ``[batch, kv_heads, tokens, head_dim]`` per layer). Per request:

1. the prompt's chained block keys are computed and the longest cached prefix is looked up;
2. those blocks are leased (pinned in host memory, promoted from disk if needed) and copied into a
   fresh ``DynamicCache`` with one bulk copy per layer from the zero-copy views;
3. the model runs only on the uncached suffix (always at least the last prompt token, for logits);
4. the newly completed prompt blocks (and, as decoding fills them, generated blocks) are written
   into freshly allocated slots in place and committed;
5. tokens are streamed greedily; on sampled decode steps per-layer hooks reduce eager attention
   into per-block attention mass, reported with ``touch`` for the attention-guided policy.

Stored blocks use the model's cache dtype unless ``store_dtype`` asks for 16-bit, so by default a
warm run computes exactly what a cold one does.

Example:
    >>> lm = attach(model, socket=None, model_id="smollm2-135m-instruct")
    >>> gen = lm.stream(token_ids, max_new_tokens=32, eos_token_id=tok.eos_token_id)
    >>> text = tok.decode(list(gen))
    >>> gen.stats.cached_tokens, gen.stats.ttft_s
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tierkv.core.errors import TierKVError
from tierkv.core.layout import Layout, dtype_name

log = logging.getLogger(__name__)

DEFAULT_BLOCK_TOKENS = 16


# --- transformers cache handling, kept in one place so version drift touches only these ----------

def text_config(model: Any) -> Any:
    """The decoder config of a model (multimodal wrappers nest it)."""
    cfg = model.config
    getter = getattr(cfg, "get_text_config", None)
    if getter is not None:
        try:
            return getter(decoder=True)
        except TypeError:
            return getter()
    return cfg


def model_layout(model: Any, block_tokens: int = DEFAULT_BLOCK_TOKENS, dtype: Any = None) -> Layout:
    """The tierkv :class:`~tierkv.core.layout.Layout` of a model's KV cache.

    Args:
        model: a transformers causal LM.
        block_tokens: tokens per block.
        dtype: stored element type; default the model's dtype (what its cache holds).

    Raises:
        ValueError: the model has sliding-window or other non-full-attention layers, whose
            ``DynamicCache`` layers do not keep every token.
    """
    cfg = text_config(model)
    layer_types = getattr(cfg, "layer_types", None) or []
    odd = sorted({t for t in layer_types if t != "full_attention"})
    if odd or getattr(cfg, "use_sliding_window", False) or _sliding_cache(model):
        raise ValueError(f"only full-attention models are supported, this one has {odd or 'sliding windows'}")
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return Layout(num_layers=cfg.num_hidden_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                  block_tokens=block_tokens, dtype=dtype if dtype is not None else model.dtype)


def _sliding_cache(model: Any) -> bool:
    """Whether the model's own ``DynamicCache`` has sliding-window layers (configs do not always say)."""
    try:
        cache = new_cache(model)
    except (TypeError, AttributeError, ValueError, KeyError):
        return False
    return any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", []))


def new_cache(model: Any) -> Any:
    """An empty ``DynamicCache`` for ``model``."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # transformers < 4.56 takes no config
        return DynamicCache()


def layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, values)`` of one layer, each ``[batch, kv_heads, tokens, head_dim]``."""
    if hasattr(cache, "layers"):  # transformers >= 4.56: a list of cache layers
        lay = cache.layers[layer]
        return lay.keys, lay.values
    if hasattr(cache, "key_cache"):
        return cache.key_cache[layer], cache.value_cache[layer]
    return cache[layer][0], cache[layer][1]


def set_layer(cache: Any, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Make ``keys``/``values`` ([batch, kv_heads, tokens, head_dim]) the content of an empty cache layer.

    transformers' plain ``DynamicLayer`` takes the tensors as they are (``update`` would concatenate
    them onto an empty tensor: a second full copy); any other layer goes through ``cache.update``.
    """
    layers = getattr(cache, "layers", None)
    lay = layers[layer] if layers is not None and layer < len(layers) else None
    if lay is not None and type(lay).__name__ == "DynamicLayer" and not getattr(lay, "is_initialized", True):
        try:
            lay.lazy_initialization(keys, values)
            lay.keys, lay.values = keys, values
            if lay.get_seq_length() == keys.shape[-2]:
                return
        except (AttributeError, TypeError):
            pass
        lay.lazy_initialization(keys, values)  # back to empty, then the public way
    cache.update(keys, values, layer)


def cache_length(cache: Any) -> int:
    """Tokens held by the cache."""
    return int(cache.get_seq_length())


class Forward:
    """Calls a model for one step with a cache, across the keyword renames of transformers 5.x
    (``past_key_values`` -> ``cache``; ``logits_to_keep``)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keep_last = "logits_to_keep" in params or "num_logits_to_keep" in params
        self.keep_kw = "logits_to_keep" if "logits_to_keep" in params else "num_logits_to_keep"

    def __call__(self, input_ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        """Run ``input_ids`` ([1, n]) on top of ``cache``; return the last position's logits [vocab]
        and the (updated) cache."""
        kwargs: dict[str, Any] = {self.cache_kw: cache, "use_cache": True}
        if self.keep_last:  # skip the vocabulary projection of every position but the last
            kwargs[self.keep_kw] = 1
        with torch.inference_mode():
            out = self.model(input_ids=input_ids, **kwargs)
        new = getattr(out, "cache", None)
        if new is None:
            new = getattr(out, "past_key_values", None)
        return out.logits[0, -1], (new if new is not None else cache)


def eos_ids(model: Any, eos_token_id: int | Sequence[int] | None) -> set[int]:
    """The end-of-sequence ids to stop at: the argument, else the model's generation config."""
    if eos_token_id is None:
        gc = getattr(model, "generation_config", None)
        eos_token_id = getattr(gc, "eos_token_id", None) if gc is not None else None
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(t) for t in eos_token_id}


# --- results -----------------------------------------------------------------------------------

@dataclass
class GenerationStats:
    """Figures of one request; filled in as the generation runs."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens whose KV came from tierkv (not run through the model)."""
    cached_blocks_by_tier: dict[str, int] = field(default_factory=dict)
    """Blocks served, by the tier each was in when looked up (``host``/``disk``/...)."""
    computed_tokens: int = 0
    """Prompt tokens run through the model."""
    new_tokens: int = 0
    stored_blocks: int = 0
    """Blocks committed by this request (prompt and generated)."""
    touches: int = 0
    """``touch`` calls made (sampled decode steps)."""
    errors: int = 0
    """tierkv calls that failed; the generation went on without them."""
    load_s: float = 0.0
    """Lookup, lease and cache build."""
    prefill_s: float = 0.0
    """Model time on the uncached suffix."""
    ttft_s: float = 0.0
    """Request start to the first token."""
    store_s: float = 0.0
    """Time spent writing and committing blocks."""
    decode_s: float = 0.0
    """Wall time of the decode steps (after the first token), stores and touches included."""

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the first one (0 when fewer than two tokens)."""
        steps = self.new_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain fields and derived rates, for JSON."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["decode_tokens_per_s"] = self.decode_tokens_per_s
        return d


class Generation:
    """A streaming greedy generation: iterate for token ids; ``stats`` and ``tokens`` fill in as it runs."""

    def __init__(self, run: Callable[[Generation], Iterator[int]], prompt_tokens: int) -> None:
        self.stats = GenerationStats(prompt_tokens=prompt_tokens)
        self.tokens: list[int] = []
        self._it = run(self)

    def __iter__(self) -> Iterator[int]:
        for token in self._it:
            self.tokens.append(token)
            self.stats.new_tokens = len(self.tokens)
            yield token

    def run(self) -> list[int]:
        """Consume the stream; returns the generated ids."""
        for _ in self:
            pass
        return self.tokens


def _greedy(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits))


def plain_generate(model: Any, prompt_ids: Sequence[int], max_new_tokens: int,
                   eos_token_id: int | Sequence[int] | None = None) -> Generation:
    """The reference loop without tierkv: full prefill, then greedy decoding on a ``DynamicCache``.

    Args:
        model: a transformers causal LM.
        prompt_ids: prompt token ids.
        max_new_tokens: tokens to generate at most.
        eos_token_id: stop ids (default the model's).
    """
    ids = _check_prompt(prompt_ids, max_new_tokens)
    fwd, stops = Forward(model), eos_ids(model, eos_token_id)
    device = next(model.parameters()).device

    def run(gen: Generation) -> Iterator[int]:
        st = gen.stats
        t0 = time.perf_counter()
        logits, cache = fwd(torch.tensor([ids], dtype=torch.long, device=device), new_cache(model))
        token = _greedy(logits)
        st.computed_tokens = len(ids)
        st.ttft_s = st.prefill_s = time.perf_counter() - t0
        yield token
        t1 = time.perf_counter()
        for _ in range(max_new_tokens - 1):
            if token in stops:
                break
            logits, cache = fwd(torch.tensor([[token]], dtype=torch.long, device=device), cache)
            token = _greedy(logits)
            st.decode_s = time.perf_counter() - t1
            yield token

    return Generation(run, len(ids))


def _check_prompt(prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise ValueError("the prompt must hold at least one token")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    return ids


# --- attention mass ----------------------------------------------------------------------------

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


# --- the attached model ------------------------------------------------------------------------

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

    def _store(self, cache: Any, keys: Sequence[bytes], first_block: int, st: GenerationStats) -> int:
        """Write blocks ``first_block .. first_block + len(keys)`` of ``cache`` into new slots and
        commit them; returns blocks committed (0 on failure)."""
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
                self.client.commit(list(keys), slots)
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
        ids = _check_prompt(prompt_ids, max_new_tokens)
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
        token = _greedy(logits)
        st.computed_tokens = len(ids) - use
        st.ttft_s = time.perf_counter() - t0
        st.prefill_s = st.ttft_s - st.load_s
        yield token

        t1 = time.perf_counter()
        # Blocks known to be in tierkv, in order: the leased prefix, then what this request commits.
        stored = list(keys[:held])
        if len(keys) > held:
            done = self._store(cache, keys[held:], held, st)
            stored += keys[held:held + done]
        seq = list(ids)
        for step in range(max_new_tokens - 1):
            if token in stops:
                break
            seq.append(token)
            x = torch.tensor([[token]], dtype=torch.long, device=self._device)
            sampled = self.touch_every > 0 and step % self.touch_every == 0 and self._probe.usable
            if sampled:
                logits, cache = self._probe.run(lambda x=x, cache=cache: self._fwd(x, cache))
                self._touch(stored, st)
            else:
                logits, cache = self._fwd(x, cache)
            token = _greedy(logits)
            # The cache now holds len(seq) tokens: commit a block the moment it is full.
            if self.store_generated and len(seq) % T == 0 and len(stored) == len(seq) // T - 1:
                parent = stored[-1] if stored else None
                new = self.client.block_keys(seq[-T:], parent=parent)
                if self._store(cache, new, len(stored), st):
                    stored += new
            st.decode_s = time.perf_counter() - t1
            yield token


def attach(model: Any, socket: str | None = None, *, model_id: str | None = None,
           block_tokens: int = DEFAULT_BLOCK_TOKENS, store_dtype: Any = None, **kwargs: Any) -> AttachedLM:
    """Connect to a tierkv daemon with ``model``'s layout and return the attached model.

    Args:
        model: a transformers causal LM.
        socket: daemon socket path (``None``: the default path).
        model_id: the namespace's model name (default the config's ``_name_or_path``).
        block_tokens: tokens per block.
        store_dtype: stored dtype; default the model's cache dtype (exact warm runs). ``"bfloat16"``
            or ``"float16"`` halve the bytes of a float32 model.
        **kwargs: passed to :class:`AttachedLM`.
    """
    from tierkv.client.client import Client

    layout = model_layout(model, block_tokens, dtype_name(store_dtype) if store_dtype is not None else None)
    name = model_id or str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
    client = Client.connect(socket, model=name, layout=layout)
    return AttachedLM(model, client, owns_client=True, **kwargs)


class ChatSession:
    """A multi-turn chat: each turn's prompt is the whole conversation so far, with the tokenizer's
    chat template, so every turn reuses the blocks of the turns before it.

    Args:
        lm: the attached model (or any object with ``stream(ids, max_new_tokens, eos_token_id)``).
        tokenizer: the model's tokenizer (with a chat template).
        system: an optional system message.
    """

    def __init__(self, lm: Any, tokenizer: Any, system: str | None = None) -> None:
        self.lm = lm
        self.tokenizer = tokenizer
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []

    def prompt_ids(self, user: str) -> list[int]:
        """Token ids of the conversation plus ``user``, ending with the assistant's turn header."""
        text = self.tokenizer.apply_chat_template(self.messages + [{"role": "user", "content": user}],
                                                  tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def turn(self, user: str, max_new_tokens: int = 32,
             on_token: Callable[[int], None] | None = None) -> tuple[str, Generation]:
        """Ask ``user``; returns the reply text and the finished generation."""
        ids = self.prompt_ids(user)
        gen = self.lm.stream(ids, max_new_tokens, self.tokenizer.eos_token_id)
        for token in gen:
            if on_token is not None:
                on_token(token)
        reply = self.tokenizer.decode(gen.tokens, skip_special_tokens=True).strip()
        self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        return reply, gen


def chat_turns(lines: Iterable[str]) -> list[str]:
    """Non-empty stripped lines, one user turn each."""
    return [s.strip() for s in lines if s.strip()]

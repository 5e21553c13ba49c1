"""A streaming greedy generation, its figures, and the reference loop without tierkv."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tierkv.integrations.transformers.cache import Forward, eos_ids, new_cache


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


def greedy(logits: torch.Tensor) -> int:
    """The argmax token of ``logits``."""
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
    ids = check_prompt(prompt_ids, max_new_tokens)
    fwd, stops = Forward(model), eos_ids(model, eos_token_id)
    device = next(model.parameters()).device

    def run(gen: Generation) -> Iterator[int]:
        st = gen.stats
        t0 = time.perf_counter()
        logits, cache = fwd(torch.tensor([ids], dtype=torch.long, device=device), new_cache(model))
        token = greedy(logits)
        st.computed_tokens = len(ids)
        st.ttft_s = st.prefill_s = time.perf_counter() - t0
        yield token
        t1 = time.perf_counter()
        for _ in range(max_new_tokens - 1):
            if token in stops:
                break
            logits, cache = fwd(torch.tensor([[token]], dtype=torch.long, device=device), cache)
            token = greedy(logits)
            st.decode_s = time.perf_counter() - t1
            yield token

    return Generation(run, len(ids))


def check_prompt(prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """The prompt as ints; ``ValueError`` for an empty prompt or ``max_new_tokens < 1``."""
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise ValueError("the prompt must hold at least one token")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    return ids

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

from tierkv.integrations.transformers.attached import AttachedLM, attach
from tierkv.integrations.transformers.cache import (
    DEFAULT_BLOCK_TOKENS,
    Forward,
    cache_length,
    eos_ids,
    layer_kv,
    model_layout,
    new_cache,
    set_layer,
    text_config,
)
from tierkv.integrations.transformers.chat import ChatSession, chat_turns
from tierkv.integrations.transformers.generation import Generation, GenerationStats, plain_generate
from tierkv.integrations.transformers.probe import AttentionProbe

__all__ = ["DEFAULT_BLOCK_TOKENS", "AttachedLM", "AttentionProbe", "ChatSession", "Forward", "Generation",
           "GenerationStats", "attach", "cache_length", "chat_turns", "eos_ids", "layer_kv", "model_layout",
           "new_cache", "plain_generate", "set_layer", "text_config"]

"""A multi-turn chat over an attached model, each turn reusing the conversation's blocks."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from tierkv.integrations.transformers.generation import Generation


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

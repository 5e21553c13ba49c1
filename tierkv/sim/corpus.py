"""The trace corpus placement is measured on: named, seeded traces of the shapes serving sees.

``synthetic`` is the Mooncake synthetic trace (a file); the others are generated:

- ``chat``: multi-turn chat (:mod:`~tierkv.sim.chat_trace` defaults).
- ``chat-idle``: chat with long idle gaps (a fifth of turns, 15 min on average) and abandoned
  conversations (a third end after one turn).
- ``rag``: a shared system prompt, a document of a Zipf-popular pool, a short question
  (:mod:`~tierkv.sim.rag_trace`).
- ``agent``: long shared tool prompts, per-session context growing with tool outputs, sessions
  that pause and resume (:mod:`~tierkv.sim.agent_trace`).
- ``returns``: prompts of their own, a tenth of them asked again once, long after host memory let
  them go (:mod:`~tierkv.sim.returns_trace`): selective disk admission loses to writing every victim.

``TUNING`` names the traces settings are chosen on; ``HELD_OUT`` the traces they are only reported on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tierkv.sim import agent_trace, chat_trace, rag_trace, returns_trace
from tierkv.sim.gen_common import json_lines
from tierkv.sim.trace import Request, load_trace, parse_trace

TUNING = ("synthetic", "chat")
HELD_OUT = ("chat-idle", "rag", "agent", "returns")
NAMES = (*TUNING, *HELD_OUT)

_GENERATED: dict[str, Callable[[int], list[dict]]] = {
    "chat": lambda seed: chat_trace.generate(chat_trace.ChatTraceSpec(seed=seed)),
    "chat-idle": lambda seed: chat_trace.generate(chat_trace.ChatTraceSpec(
        seed=seed, idle_p=0.2, idle_s=900.0, abandon_p=0.33)),
    "rag": lambda seed: rag_trace.generate(rag_trace.RagTraceSpec(seed=seed)),
    "agent": lambda seed: agent_trace.generate(agent_trace.AgentTraceSpec(seed=seed)),
    "returns": lambda seed: returns_trace.generate(returns_trace.ReturnsTraceSpec(seed=seed)),
}


def generated(name: str, seed: int = 0) -> list[dict]:
    """The Mooncake-format lines (as dicts) of the generated trace ``name``."""
    try:
        gen = _GENERATED[name]
    except KeyError:
        raise ValueError(f"no generated trace {name!r} (known: {', '.join(_GENERATED)})") from None
    return gen(seed)


def requests(name: str, synthetic: str | Path | None = None, seed: int = 0) -> list[Request]:
    """The requests of corpus trace ``name``; ``synthetic`` is the path of the Mooncake synthetic trace."""
    if name == "synthetic":
        if synthetic is None:
            raise ValueError("the synthetic trace needs its path")
        return load_trace(synthetic)
    return parse_trace(json_lines(generated(name, seed)), name)

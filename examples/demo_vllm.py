"""The scripted multi-turn chat through vLLM's OpenAI server with tierkv as its KV connector.

Each turn is sent twice, as a client would send it (streamed, TTFT at the first token): once with a
fresh ``cache_salt``, which no cache has seen (a full recompute of the same prompt), then as the
conversation itself, whose earlier turns tierkv holds. vLLM's own KV cache is kept small (a dozen
blocks), so the recompute pushes the conversation out of it, as other users' requests would: the
conversation's prefix then comes from tierkv. In the middle the vLLM server is restarted, which
empties vLLM's cache entirely. Per turn: prompt tokens, tokens served from tierkv (by tier, from the
daemon's hit counters), both TTFTs and whether both replies agree.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _conversation import SYSTEM  # tools/ (on the path of examples/demo.py and examples/mainjob.py)
from _vllm_server import BLOCK_TOKENS, ChatReply, VllmServer

from tierkv.client.admin import request

__all__ = ["VllmTurn", "format_vllm_turn", "run_vllm_chat"]

VLLM_BLOCKS = 12  # vLLM's own KV cache: 12 blocks of 128 tokens, one conversation's worth


@dataclass
class VllmTurn:
    """What one turn measured."""

    turn: int
    prompt_tokens: int
    cached_tokens: int            # vLLM's cached_tokens: its own prefix cache plus tierkv
    tierkv_tokens: dict[str, int]  # tokens tierkv served, by tier
    ttft_s: float
    ttft_recompute_s: float
    same_reply: bool
    after_restart: bool
    user: str
    reply: str

    @property
    def speedup(self) -> float:
        """Recompute TTFT over TTFT with tierkv."""
        return self.ttft_recompute_s / self.ttft_s if self.ttft_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain fields plus the speed-up."""
        return {**asdict(self), "speedup": round(self.speedup, 2)}


def _hits(socket: str, block_tokens: int) -> dict[str, int]:
    tiers = request(socket, "STATS")["tiers"]
    return {name: int(t.get("hits", 0)) * block_tokens for name, t in tiers.items()}


def run_vllm_chat(model_dir: str, socket: str, turns: Sequence[str], log_dir: Path, *, max_tokens: int = 32,
                  restart_after: int | None = None, on_turn: Callable[[VllmTurn], None] | None = None,
                  on_event: Callable[[str], None] | None = None) -> list[VllmTurn]:
    """Run the chat; vLLM is restarted after turn ``restart_after`` (None: half-way)."""
    say = on_event or (lambda _m: None)
    restart_after = len(turns) // 2 if restart_after is None else restart_after
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    server = VllmServer(model_dir, socket, log_dir / "vllm.log", num_blocks=VLLM_BLOCKS)
    reports: list[VllmTurn] = []
    say(f"starting vLLM's OpenAI server with tierkv as its KV connector (log {server.log_path}) ...")
    _start(server)
    try:
        for i, user in enumerate(turns, 1):
            messages.append({"role": "user", "content": user})
            recompute = server.chat(messages, max_tokens=max_tokens, salt=secrets.token_hex(8))
            before = _hits(socket, BLOCK_TOKENS)
            reply = server.chat(messages, max_tokens=max_tokens)
            after = _hits(socket, BLOCK_TOKENS)
            served = {t: after[t] - before.get(t, 0) for t in after if after[t] > before.get(t, 0)}
            rep = _turn(i, user, reply, recompute, served, i == restart_after + 1)
            reports.append(rep)
            if on_turn:
                on_turn(rep)
            messages.append({"role": "assistant", "content": reply.text})
            if i == restart_after and i < len(turns):
                say("restarting vLLM (its own KV cache starts empty; tierkv keeps the blocks) ...")
                server.stop()
                _start(server)
    finally:
        server.stop()
    return reports


def _start(server: VllmServer) -> None:
    """Start the server and send one tiny request: the first request of a process pays one-off set-up
    costs that belong to neither measurement."""
    server.start()
    server.chat([{"role": "user", "content": "Hello"}], max_tokens=1)


def _turn(i: int, user: str, reply: ChatReply, recompute: ChatReply, served: dict[str, int],
          after_restart: bool) -> VllmTurn:
    return VllmTurn(i, reply.prompt_tokens, reply.cached_tokens, served, reply.ttft_s, recompute.ttft_s,
                    reply.text == recompute.text, after_restart, user, reply.text)


def format_vllm_turn(r: VllmTurn) -> str:
    """Human-readable lines for one turn."""
    tiers = ", ".join(f"{n} {t}" for t, n in sorted(r.tierkv_tokens.items())) or "none"
    total = sum(r.tierkv_tokens.values())
    same = "same reply as recompute" if r.same_reply else "REPLY DIFFERS FROM RECOMPUTE"
    note = "  (vLLM restarted before this turn)" if r.after_restart else ""
    return (f"turn {r.turn}: prompt {r.prompt_tokens} tokens, {r.cached_tokens} cached, {total} of them from "
            f"tierkv ({tiers}){note}\n"
            f"  TTFT {r.ttft_s * 1e3:7.0f} ms with tierkv | {r.ttft_recompute_s * 1e3:7.0f} ms recomputing | "
            f"{r.speedup:5.1f}x | {same}\n"
            f"  user:      {r.user}\n"
            f"  assistant: {r.reply}\n")

"""A generated multi-turn chat trace in the Mooncake format (deterministic for a seed).

Conversations start as a Poisson process. Each opens with one of a few shared system prompts; every
turn's prompt is the previous prompt plus the previous reply plus a new user message, sent after a
think time (exponential), so reuse is dominated by recency: the next turn of a live conversation.
With ``idle_p`` a turn is followed now and then by a long idle gap (the user comes back later), and
with ``abandon_p`` a conversation is left after its first turn.
A turn's full blocks keep their ids in later turns (equal id means equal prefix); the partial last
block gets a new id when the next turn fills it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from tierkv.sim.gen_common import check_ranges, json_lines


@dataclass(frozen=True)
class ChatTraceSpec:
    """Shape of the generated trace.

    Attributes:
        conversations: conversations started.
        rate_per_s: conversation starts per second.
        mean_turns: mean turns per conversation (geometric, at least 1).
        think_s: mean seconds between a reply and the next turn.
        system_prompts: distinct shared system prompts.
        system_tokens: tokens of each system prompt.
        user_tokens: (min, max) tokens of a user message.
        reply_tokens: (min, max) tokens of a reply.
        block_tokens: tokens per ``hash_ids`` entry.
        seed: random seed.
        idle_p: chance that a turn is followed by a long idle gap instead of the think time.
        idle_s: mean seconds of a long idle gap.
        abandon_p: chance that a conversation is left after its first turn.
    """

    conversations: int = 800
    rate_per_s: float = 1.0
    mean_turns: float = 5.0
    think_s: float = 40.0
    system_prompts: int = 8
    system_tokens: int = 2048
    user_tokens: tuple[int, int] = (200, 3000)
    reply_tokens: tuple[int, int] = (100, 800)
    block_tokens: int = 512
    seed: int = 0
    idle_p: float = 0.0
    idle_s: float = 900.0
    abandon_p: float = 0.0

    def __post_init__(self) -> None:
        if not (0 <= self.idle_p <= 1 and 0 <= self.abandon_p <= 1 and self.idle_s >= 0):
            raise ValueError("0 <= idle_p, abandon_p <= 1 and idle_s >= 0 are needed")
        if self.conversations < 1 or self.rate_per_s <= 0 or self.mean_turns < 1 or self.think_s < 0:
            raise ValueError("conversations >= 1, rate_per_s > 0, mean_turns >= 1 and think_s >= 0 are needed")
        check_ranges(user_tokens=self.user_tokens, reply_tokens=self.reply_tokens)
        if self.system_prompts < 1 or self.system_tokens < 0 or self.block_tokens < 1:
            raise ValueError("system_prompts >= 1, system_tokens >= 0 and block_tokens >= 1 are needed")


def _ids(spec: ChatTraceSpec, conv: int, system: int, tokens: int, turn: int) -> list[str]:
    """Block ids of a prompt of ``tokens`` tokens: the system prompt's full blocks are shared."""
    bt = spec.block_tokens
    shared = spec.system_tokens // bt
    full, partial = divmod(tokens, bt)
    out = [f"s{system}.{i}" if i < shared else f"c{conv}.{i}" for i in range(full)]
    if partial:
        out.append(f"c{conv}.{full}.t{turn}")
    return out


def generate(spec: ChatTraceSpec) -> list[dict]:
    """The trace's requests in timestamp order (Mooncake fields: timestamp in ms, input_length,
    output_length, hash_ids)."""
    rng = random.Random(spec.seed)
    events: list[tuple[float, int, dict]] = []
    start = 0.0
    for conv in range(spec.conversations):
        start += rng.expovariate(spec.rate_per_s)
        system = rng.randrange(spec.system_prompts)
        turns = 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / spec.mean_turns)) \
            if spec.mean_turns > 1 else 1
        if spec.abandon_p and rng.random() < spec.abandon_p:
            turns = 1
        t, context = start, spec.system_tokens
        for turn in range(turns):
            context += rng.randint(*spec.user_tokens)
            reply = rng.randint(*spec.reply_tokens)
            events.append((t, len(events), {"input_length": context, "output_length": reply,
                                            "hash_ids": _ids(spec, conv, system, context, turn)}))
            context += reply
            if spec.idle_p and rng.random() < spec.idle_p:
                t += rng.expovariate(1.0 / spec.idle_s) if spec.idle_s else 0.0
            else:
                t += rng.expovariate(1.0 / spec.think_s) if spec.think_s else 0.0
    events.sort(key=lambda e: (e[0], e[1]))
    return [{"timestamp": int(round(ts * 1000)), **req} for ts, _, req in events]


def lines(spec: ChatTraceSpec) -> Iterator[str]:
    """The trace as JSON lines."""
    return json_lines(generate(spec))

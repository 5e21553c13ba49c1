"""A generated agent trace in the Mooncake format (deterministic for a seed).

Sessions start as a Poisson process. Each opens with one of a few long shared tool prompts; every
step's prompt is the previous prompt plus the model's last action and a tool output, sent after the
tool's latency. Now and then a session pauses (waiting on a person or a slow job) and resumes
minutes later; sessions end after a geometric number of steps.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from tierkv.sim.gen_common import check_ranges, poisson_times


@dataclass(frozen=True)
class AgentTraceSpec:
    """Shape of the generated trace.

    Attributes:
        sessions: sessions started.
        rate_per_s: session starts per second.
        mean_steps: mean steps per session (geometric, at least 1).
        step_s: mean seconds between a step's answer and the next step (the tool's latency).
        pause_p: chance that a session pauses after a step.
        pause_s: mean seconds of a pause.
        tool_prompts: distinct shared tool prompts.
        tool_tokens: tokens of each tool prompt (whole blocks).
        task_tokens: (min, max) tokens of the task that opens a session.
        tool_output_tokens: (min, max) tokens a tool returns per step.
        action_tokens: (min, max) tokens the model generates per step.
        block_tokens: tokens per ``hash_ids`` entry.
        seed: random seed.
    """

    sessions: int = 300
    rate_per_s: float = 0.3
    mean_steps: float = 12.0
    step_s: float = 6.0
    pause_p: float = 0.08
    pause_s: float = 240.0
    tool_prompts: int = 3
    tool_tokens: int = 6144
    task_tokens: tuple[int, int] = (100, 1500)
    tool_output_tokens: tuple[int, int] = (100, 2500)
    action_tokens: tuple[int, int] = (30, 300)
    block_tokens: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.rate_per_s <= 0 or self.mean_steps < 1 or self.step_s < 0:
            raise ValueError("sessions >= 1, rate_per_s > 0, mean_steps >= 1 and step_s >= 0 are needed")
        if not 0 <= self.pause_p <= 1 or self.pause_s < 0:
            raise ValueError("0 <= pause_p <= 1 and pause_s >= 0 are needed")
        check_ranges(task_tokens=self.task_tokens, tool_output_tokens=self.tool_output_tokens,
                     action_tokens=self.action_tokens)
        if self.tool_prompts < 1 or self.tool_tokens < 0 or self.tool_tokens % self.block_tokens:
            raise ValueError("tool_prompts >= 1 and a tool prompt of whole blocks are needed")


def _ids(spec: AgentTraceSpec, sess: int, tool: int, tokens: int, step: int) -> list[str]:
    """Block ids of a prompt of ``tokens`` tokens: the tool prompt's blocks are shared."""
    bt = spec.block_tokens
    shared = spec.tool_tokens // bt
    full, partial = divmod(tokens, bt)
    out = [f"t{tool}.{i}" if i < shared else f"a{sess}.{i}" for i in range(full)]
    if partial:
        out.append(f"a{sess}.{full}.s{step}")
    return out


def generate(spec: AgentTraceSpec) -> list[dict]:
    """The trace's requests in timestamp order (Mooncake fields)."""
    rng = random.Random(spec.seed)
    events: list[tuple[float, int, dict]] = []
    for sess, start in enumerate(poisson_times(rng, spec.sessions, spec.rate_per_s)):
        tool = rng.randrange(spec.tool_prompts)
        steps = 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / spec.mean_steps)) \
            if spec.mean_steps > 1 else 1
        t, context = start, spec.tool_tokens + rng.randint(*spec.task_tokens)
        for step in range(steps):
            action = rng.randint(*spec.action_tokens)
            events.append((t, len(events), {"input_length": context, "output_length": action,
                                            "hash_ids": _ids(spec, sess, tool, context, step)}))
            context += action + rng.randint(*spec.tool_output_tokens)
            t += rng.expovariate(1.0 / spec.step_s) if spec.step_s else 0.0
            if rng.random() < spec.pause_p:
                t += rng.expovariate(1.0 / spec.pause_s) if spec.pause_s else 0.0
    events.sort(key=lambda e: (e[0], e[1]))
    return [{"timestamp": int(round(ts * 1000)), **req} for ts, _, req in events]

"""A generated trace of late returns in the Mooncake format (deterministic for a seed).

Prompts of their own (no shared prefix) arrive as a Poisson process; a fraction of them comes back
once, whole, a fixed number of requests later (a retried or re-asked request, a document read
again). Host memory is gone by then, so every return is a disk hit or a recompute. Each class of
block comes back rarely, so an admission rule that weighs the chance of a return against the cost
of a write learns to skip them while the writer is busy, and loses every return it skipped: the
trace where writing every victim wins, which the admission shadow must catch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tierkv.sim.gen_common import check_ranges, poisson_times


@dataclass(frozen=True)
class ReturnsTraceSpec:
    """Shape of the generated trace.

    Attributes:
        requests: requests generated, returns included.
        rate_per_s: requests per second.
        blocks: blocks of each prompt.
        return_p: the chance a prompt comes back.
        gap: requests between a prompt and its return.
        output_tokens: (min, max) tokens of an answer.
        block_tokens: tokens per ``hash_ids`` entry.
        seed: random seed.
    """

    requests: int = 20000
    rate_per_s: float = 20.0
    blocks: int = 4
    return_p: float = 0.1
    gap: int = 600
    output_tokens: tuple[int, int] = (20, 400)
    block_tokens: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 1 or self.rate_per_s <= 0 or self.blocks < 1 or self.gap < 1:
            raise ValueError("requests, blocks and gap >= 1 and rate_per_s > 0 are needed")
        if not 0 <= self.return_p <= 1:
            raise ValueError(f"return_p must be within 0..1, got {self.return_p!r}")
        check_ranges(output_tokens=self.output_tokens)


def generate(spec: ReturnsTraceSpec) -> list[dict]:
    """The trace's requests in timestamp order (Mooncake fields)."""
    rng = random.Random(spec.seed)
    due: dict[int, list[int]] = {}  # request index -> prompts coming back there
    order: list[int] = []
    fresh = 0
    while len(order) < spec.requests:
        order.extend(due.pop(len(order), []))
        order.append(fresh)
        if rng.random() < spec.return_p:
            due.setdefault(len(order) + spec.gap, []).append(fresh)
        fresh += 1
    times = poisson_times(rng, spec.requests, spec.rate_per_s)
    return [{"timestamp": int(round(t * 1000)), "input_length": spec.blocks * spec.block_tokens,
             "output_length": rng.randint(*spec.output_tokens),
             "hash_ids": [f"p{p}.{j}" for j in range(spec.blocks)]}
            for p, t in zip(order[:spec.requests], times)]

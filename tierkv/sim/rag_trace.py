"""A generated retrieval-augmented (RAG) trace in the Mooncake format (deterministic for a seed).

Requests arrive as a Poisson process. Each is one shared system prompt, one document drawn from a
pool with Zipf popularity, and a short question of its own: reuse is the document (a popular one
comes back often, the long tail rarely), and nothing after the question is ever shared.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass

from tierkv.sim.gen_common import check_ranges, poisson_times


@dataclass(frozen=True)
class RagTraceSpec:
    """Shape of the generated trace.

    Attributes:
        requests: requests generated.
        rate_per_s: requests per second.
        documents: documents in the pool.
        zipf_s: exponent of the documents' Zipf popularity (rank r is drawn with weight r^-s).
        document_blocks: (min, max) blocks of a document.
        system_tokens: tokens of the shared system prompt (whole blocks).
        question_tokens: (min, max) tokens of a question.
        output_tokens: (min, max) tokens of an answer.
        block_tokens: tokens per ``hash_ids`` entry.
        seed: random seed.
    """

    requests: int = 3000
    rate_per_s: float = 4.0
    documents: int = 3000
    zipf_s: float = 0.9
    document_blocks: tuple[int, int] = (2, 14)
    system_tokens: int = 1024
    question_tokens: tuple[int, int] = (20, 300)
    output_tokens: tuple[int, int] = (20, 400)
    block_tokens: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 1 or self.rate_per_s <= 0 or self.documents < 1 or self.zipf_s < 0:
            raise ValueError("requests >= 1, rate_per_s > 0, documents >= 1 and zipf_s >= 0 are needed")
        check_ranges(document_blocks=self.document_blocks, question_tokens=self.question_tokens,
                     output_tokens=self.output_tokens)
        if self.system_tokens < 0 or self.system_tokens % self.block_tokens:
            raise ValueError("system_tokens must be a whole number of blocks")


def generate(spec: RagTraceSpec) -> list[dict]:
    """The trace's requests in timestamp order (Mooncake fields)."""
    rng = random.Random(spec.seed)
    bt = spec.block_tokens
    sizes = [rng.randint(*spec.document_blocks) for _ in range(spec.documents)]
    order = list(range(spec.documents))
    rng.shuffle(order)  # popularity rank is independent of the document's size
    cum, total = [], 0.0
    for rank in range(1, spec.documents + 1):
        total += rank ** -spec.zipf_s
        cum.append(total)
    system = [f"sys.{i}" for i in range(spec.system_tokens // bt)]
    out = []
    for i, t in enumerate(poisson_times(rng, spec.requests, spec.rate_per_s)):
        doc = order[bisect.bisect_left(cum, rng.random() * total)]
        question = rng.randint(*spec.question_tokens)
        ids = [*system, *(f"d{doc}.{j}" for j in range(sizes[doc]))]
        ids += [f"q{i}.{j}" for j in range(-(-question // bt))]
        out.append({"timestamp": int(round(t * 1000)), "input_length": (len(system) + sizes[doc]) * bt + question,
                    "output_length": rng.randint(*spec.output_tokens), "hash_ids": ids})
    return out

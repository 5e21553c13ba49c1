"""A trace expanded to cache pages, and the prefill cost model of recomputing them."""

from __future__ import annotations

import math
from collections.abc import Sequence

from tierkv.sim.trace import Request

NEVER = math.inf


class Workload:
    """A trace expanded to pages, with each page access's next use (for the OPT oracle).

    Attributes:
        pages: per request, page ids in prefix order (only pages holding at least one token).
        tokens: per request, tokens of each page.
        unique_pages: distinct page ids in the trace.
    """

    def __init__(self, requests: Sequence[Request], page_tokens: int = 512, trace_block_tokens: int = 512):
        if page_tokens < 1 or trace_block_tokens % page_tokens:
            raise ValueError(f"page_tokens ({page_tokens}) must divide trace_block_tokens ({trace_block_tokens})")
        self.requests = list(requests)
        self.page_tokens = page_tokens
        per = trace_block_tokens // page_tokens
        self.pages: list[list[int]] = []
        self.tokens: list[list[int]] = []
        for r in self.requests:
            pages, toks, left = [], [], r.input_tokens
            for b in r.blocks:
                for j in range(per):
                    if left <= 0:
                        break
                    pages.append(b * per + j)
                    toks.append(min(page_tokens, left))
                    left -= page_tokens
            # tokens beyond what hash_ids cover (none in well-formed traces) are never cached
            self.pages.append(pages)
            self.tokens.append(toks)
        self.unique_pages = len({p for ps in self.pages for p in ps})
        self._next: list[list[float]] | None = None

    @property
    def next_use(self) -> list[list[float]]:
        """Per request and page: index of the next request using that page (``inf`` if none)."""
        if self._next is None:
            nxt: dict[int, float] = {}
            out: list[list[float]] = [[]] * len(self.pages)
            for i in range(len(self.pages) - 1, -1, -1):
                row = []
                for p in self.pages[i]:
                    row.append(nxt.get(p, NEVER))
                    nxt[p] = i
                out[i] = row
            self._next = out
        return self._next


def prefill_seconds(start: int, end: int, rate: float, double_tokens: float) -> float:
    """Seconds to prefill tokens ``[start, end)`` when a token at position x costs
    ``(1 + x / double_tokens) / rate`` (attention grows with the context)."""
    if end <= start:
        return 0.0
    t = (end - start) / rate
    if double_tokens > 0:
        t += (end * end - start * start) / (2.0 * double_tokens * rate)
    return t


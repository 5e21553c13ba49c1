"""What a router reads: the leading tokens of a prompt each tier holds (``tierkv lookup``, ``/lookup``)."""

from __future__ import annotations

from typing import Any

TIERS = ("gpu", "host", "disk", "remote")


def tier_tokens(tiers: list[str], block_tokens: int, total: int) -> dict[str, Any]:
    """The report for a prompt of ``total`` tokens whose leading blocks are held in ``tiers`` (the
    fastest tier of each, in order): its length, the cached prefix's tokens, and per tier the tokens of
    that prefix it serves."""
    per = {t: 0 for t in TIERS}
    for t in tiers:
        per[t] = per.get(t, 0) + block_tokens
    return {"tokens": total, "cached_tokens": len(tiers) * block_tokens, "tiers": per}


def parse_token_ids(text: str) -> list[int]:
    """Token ids from a JSON list or from numbers separated by commas or white space.

    Raises:
        ValueError: anything else, or an id below 0.
    """
    import json

    text = text.strip()
    try:
        raw = json.loads(text) if text.startswith("[") else [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError("tokens must be a JSON list of ints or ints separated by commas or spaces") from None
    if not isinstance(raw, list) or not all(type(t) is int and t >= 0 for t in raw):
        raise ValueError("tokens must be non-negative ints")
    return raw

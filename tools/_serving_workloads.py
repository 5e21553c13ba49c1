"""The serving benchmark's workloads, each a Mooncake-format trace for vLLM's ``timed_trace`` dataset.

A row is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``;
each id stands for ``chunk_tokens`` prompt tokens and equal ids mean equal prefixes. vLLM's client
expands an id into tokens drawn from a generator seeded with Python's ``hash()`` of the id, so the
replay needs a fixed ``PYTHONHASHSEED`` for the same prompts in every run.

- ``trace``: a window of the shared Mooncake synthetic trace, each 512-token id mapped to
  ``chunk_tokens`` tokens, replayed on its own clock stretched to a mean request rate;
- ``chat``: multi-turn conversations (``tierkv.sim.chat_trace``): conversations start as a Poisson
  process, each turn's prompt is the whole conversation so far;
- ``long``: 4k-8k-token prompts, each a shared document plus its own question, Poisson arrivals;
- ``unique``: prompts that share nothing (ids of their own), Poisson arrivals: a load without reuse.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from tierkv.sim.chat_trace import ChatTraceSpec, generate

MOONCAKE = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
MOONCAKE_CHUNK = 512  # tokens per id in the Mooncake trace
TRACE_START = 3700  # a window of the trace where requests reuse each other's prefixes (half of its ids)
NAMES = ("trace", "chat", "long", "unique")


@dataclass
class Workload:
    """One workload's requests and how vLLM's client replays them.

    Attributes:
        name: the workload's name.
        rows: Mooncake-format requests in timestamp order (timestamps in ms, from 0).
        chunk_tokens: tokens per hash id (``--timed-trace-chunk-hash-size``).
        sec_multiplier: seconds per timestamp unit (``--timed-trace-sec-multiplier``).
    """

    name: str
    rows: list[dict]
    chunk_tokens: int
    sec_multiplier: float = 0.001

    def write(self, path: Path) -> Path:
        """Write the trace as JSON lines."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in self.rows))
        return path

    def blocks(self, row: dict, block_tokens: int = 128) -> list[int]:
        """Names of ``row``'s full ``block_tokens``-token prompt blocks (what a KV connector stores); a
        block is named by the ids that cover it, as equal ids mean equal prefixes."""
        chain, prefix = 0, []
        for h in row["hash_ids"]:
            chain = hash((chain, h))
            prefix.append(chain)
        return [prefix[min(len(prefix), -(-(b + 1) * block_tokens // self.chunk_tokens)) - 1]
                for b in range(row["input_length"] // block_tokens)]

    def working_set_blocks(self, block_tokens: int = 128) -> int:
        """Distinct full prompt blocks of every request."""
        return len({b for r in self.rows for b in self.blocks(r, block_tokens)})

    def reusable(self, device_blocks: int, block_tokens: int = 128) -> list[int]:
        """Indices of the requests a KV cache outside vLLM can speed up: in arrival order, an unbounded
        cache holds a longer prefix of the prompt than an LRU of ``device_blocks`` blocks (vLLM's own
        cache, its concurrency aside)."""
        lru: dict[int, None] = {}
        seen: set[int] = set()
        out = []
        for i, r in enumerate(self.rows):
            names = self.blocks(r, block_tokens)
            held = next((k for k, b in enumerate(names) if b not in lru), len(names))
            known = next((k for k, b in enumerate(names) if b not in seen), len(names))
            if known > held:
                out.append(i)
            seen.update(names)
            for b in names:
                lru.pop(b, None)
                lru[b] = None
            for b in list(lru)[:max(0, len(lru) - device_blocks)]:
                del lru[b]
        return out

    def summary(self) -> dict[str, float]:
        """Request count, duration on the replay clock, token totals and the working set."""
        n = len(self.rows)
        dur = self.rows[-1]["timestamp"] * self.sec_multiplier if n else 0.0
        prompt = sum(r["input_length"] for r in self.rows)
        return {"requests": n, "duration_s": dur, "rate_per_s": n / dur if dur else 0.0,
                "prompt_tokens": prompt, "mean_prompt_tokens": prompt / n if n else 0.0,
                "max_prompt_tokens": max((r["input_length"] for r in self.rows), default=0),
                "output_tokens": sum(r["output_length"] for r in self.rows),
                "working_set_blocks": self.working_set_blocks()}


def _clip(row: dict, chunk: int, max_len: int, max_output: int) -> dict:
    """Cap a request's output at ``max_output`` and its prompt so that prompt + output <= ``max_len``."""
    out = min(row["output_length"], max_output)
    inp = min(row["input_length"], max_len - out)
    ids = row["hash_ids"][: -(-inp // chunk)]
    return {"timestamp": row["timestamp"], "input_length": inp, "output_length": max(out, 1), "hash_ids": ids}


def mooncake_window(requests: int, rate: float, *, start: int = TRACE_START, chunk: int = 16, max_len: int = 8192,
                    max_output: int = 16, path: Path = MOONCAKE) -> Workload:
    """``requests`` rows of the Mooncake trace from row ``start``, each 512-token id scaled to ``chunk``
    tokens (prompt lengths scaled alike), the clock stretched so the mean rate is ``rate`` req/s."""
    scale = chunk / MOONCAKE_CHUNK
    rows = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if i < start:
                continue
            if len(rows) >= requests:
                break
            r = json.loads(line)
            r["input_length"] = max(1, round(r["input_length"] * scale))
            rows.append(_clip(r, chunk, max_len, max_output))
    t0 = rows[0]["timestamp"]
    for r in rows:
        r["timestamp"] -= t0
    native_s = rows[-1]["timestamp"] / 1000.0
    stretch = (len(rows) / rate) / native_s if native_s > 0 else 1.0
    return Workload("trace", rows, chunk, sec_multiplier=0.001 * stretch)


def chat(requests: int, rate: float, *, users: int | None = None, chunk: int = 128, max_len: int = 8192,
         max_output: int = 16, seed: int = 0, mean_turns: float = 4.0) -> Workload:
    """The first ``requests`` turns of generated conversations (starts at a Poisson rate, ``mean_turns``
    turns on average, exponential think time) whose turns arrive at about ``rate`` req/s in all."""
    conv_rate = rate / mean_turns
    spec = ChatTraceSpec(conversations=users or max(1, round(requests / mean_turns)), rate_per_s=conv_rate,
                         mean_turns=mean_turns, think_s=8.0 / rate, system_prompts=4, system_tokens=512,
                         user_tokens=(32, 256), reply_tokens=(16, 128), block_tokens=chunk, seed=seed)
    rows = [_clip(r, chunk, max_len, max_output) for r in generate(spec)[:requests]]
    return Workload("chat", rows, chunk)


def long_prompts(requests: int, rate: float, *, documents: int = 6, chunk: int = 128, max_len: int = 8192,
                 max_output: int = 16, seed: int = 0) -> Workload:
    """Prompts of 4k-8k tokens: one of ``documents`` shared documents (3.8k-7.5k tokens) plus a question
    of its own (160-288 tokens), Poisson arrivals at ``rate`` req/s."""
    rng = random.Random(seed)
    doc_chunks = [rng.randint(3840 // chunk, 7552 // chunk) for _ in range(documents)]
    rows, t = [], 0.0
    for i in range(requests):
        d = rng.randrange(documents)
        q = rng.randint(160, 288)
        out = max_output
        inp = min(doc_chunks[d] * chunk + q, max_len - out)
        q_ids = [f"q{i}.{j}" for j in range(-(-(inp - doc_chunks[d] * chunk) // chunk))]
        rows.append({"timestamp": int(round(t * 1000)), "input_length": inp, "output_length": out,
                     "hash_ids": [f"d{d}.{j}" for j in range(doc_chunks[d])] + q_ids})
        t += rng.expovariate(rate)
    return Workload("long", rows, chunk)


def unique_prompts(requests: int, rate: float, *, chunk: int = 128, tokens: tuple[int, int] = (384, 2048),
                   max_len: int = 8192, max_output: int = 16, seed: int = 0) -> Workload:
    """Prompts of ``tokens`` tokens (uniform) that share no id, with Poisson arrivals at ``rate`` req/s:
    nothing any cache holds is ever asked for again."""
    rng = random.Random(seed)
    rows, t = [], 0.0
    for i in range(requests):
        inp = min(rng.randint(*tokens), max_len - max_output)
        rows.append({"timestamp": int(round(t * 1000)), "input_length": inp, "output_length": max_output,
                     "hash_ids": [f"u{seed}.{i}.{j}" for j in range(-(-inp // chunk))]})
        t += rng.expovariate(rate)
    return Workload("unique", rows, chunk)


def build(name: str, requests: int, rate: float, *, max_output: int, seed: int = 0,
          trace_start: int = TRACE_START, trace_chunk: int = 16, max_len: int = 8192,
          chat_turns: float = 4.0) -> Workload:
    """The workload ``name`` (one of :data:`NAMES`)."""
    if name == "trace":
        return mooncake_window(requests, rate, start=trace_start, chunk=trace_chunk, max_len=max_len,
                               max_output=max_output)
    if name == "chat":
        return chat(requests, rate, max_len=max_len, max_output=max_output, seed=seed, mean_turns=chat_turns)
    if name == "long":
        return long_prompts(requests, rate, max_len=max_len, max_output=max_output, seed=seed)
    if name == "unique":
        return unique_prompts(requests, rate, max_len=max_len, max_output=max_output, seed=seed)
    raise ValueError(f"unknown workload {name!r} (one of {', '.join(NAMES)})")

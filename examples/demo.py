"""A scripted multi-turn chat with a real model whose later turns skip most of their
prefill, because their prefix KV comes back from tierkv.

Every turn's prompt is the whole conversation so far (the model's chat template), so turn ``n``
reuses the blocks of turns ``1..n-1``. For each turn the prompt is also recomputed without tierkv,
to show the TTFT it would have cost and (with ``--check``) that the reply is the same.

    .venv/bin/python examples/demo.py [--engine transformers] [--turns N] [--check] [--json]
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import click

_ROOT = Path(__file__).resolve().parents[1]
for _p in (str(_ROOT / "tools"), str(_ROOT)):  # the harness in tools/; tierkv from the checkout
    if _p not in sys.path:
        sys.path.insert(1, _p)
from _conversation import TURNS  # noqa: E402

from tierkv.core.errors import TierKVError  # noqa: E402

MODEL_ID = "smollm2-135m-instruct"


@dataclass
class TurnReport:
    """Figures of one chat turn."""

    turn: int
    user: str
    reply: str
    prompt_tokens: int
    cached_tokens: int
    cached_blocks_by_tier: dict[str, int]
    computed_tokens: int
    stored_blocks: int
    new_tokens: int
    ttft_s: float
    ttft_recompute_s: float
    decode_tokens_per_s: float
    touches: int
    matches_recompute: bool | None

    @property
    def speedup(self) -> float:
        """Recompute TTFT over tierkv TTFT."""
        return self.ttft_recompute_s / self.ttft_s if self.ttft_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain fields, for ``--json``."""
        d = dict(self.__dict__)
        d["speedup"] = round(self.speedup, 2)
        for k in ("ttft_s", "ttft_recompute_s", "decode_tokens_per_s"):
            d[k] = round(d[k], 4)
        return d


def read_turns(path: str | Path | None) -> list[str]:
    """User turns: one per non-empty line of ``path``, or the built-in script."""
    if path is None:
        return list(TURNS)
    from tierkv.integrations.transformers import chat_turns

    turns = chat_turns(Path(path).read_text().splitlines())
    if not turns:
        raise click.BadParameter(f"{path} holds no user turns", param_hint="--prompt-file")
    return turns


def run_chat(socket: str | None, turns: Sequence[str], *, max_new_tokens: int = 32, check: bool = False,
             on_turn: Callable[[TurnReport], None] | None = None, model_and_tokenizer: Any = None,
             progress: TextIO | None = None, warmup: bool = True) -> tuple[list[TurnReport], dict[str, Any]]:
    """Run the scripted chat against the daemon at ``socket``.

    Args:
        socket: daemon socket (``None``: the default path).
        turns: user messages, one per turn.
        max_new_tokens: reply length cap per turn.
        check: also generate each reply without tierkv and compare token for token.
        on_turn: called with each finished turn.
        model_and_tokenizer: ``(tokenizer, model)`` to reuse (default: load the demo model).
        progress: where model conversion progress goes (default stderr).
        warmup: run one untimed prefill first, so turn 1's timings are not a cold process's.

    Returns:
        The turn reports and the daemon's stats after the last turn.
    """
    import torch
    from _conversation import SYSTEM
    from _demo_model import load_model, sidecar_threads

    from tierkv.integrations.transformers import ChatSession, attach, plain_generate

    if model_and_tokenizer is None:
        torch.set_num_threads(sidecar_threads())
    tok, model = model_and_tokenizer or load_model(attn_implementation="sdpa", out=progress)
    reports: list[TurnReport] = []
    with attach(model, socket, model_id=MODEL_ID) as lm, torch.inference_mode():
        chat = ChatSession(lm, tok, system=SYSTEM)
        if warmup and turns:
            # One untimed prefill of the first prompt's size: a process's first large forward pays for
            # fresh memory (page faults), which would otherwise be charged to turn 1's tierkv run.
            plain_generate(model, chat.prompt_ids(turns[0]), 1).run()
        for i, user in enumerate(turns, 1):
            ids = chat.prompt_ids(user)
            reply, gen = chat.turn(user, max_new_tokens)
            if check:
                ref = plain_generate(model, ids, max_new_tokens, tok.eos_token_id)
                ref.run()
                matches: bool | None = ref.tokens == gen.tokens
            else:
                ref = plain_generate(model, ids, 1)  # the first token is all TTFT needs
                ref.run()
                matches = None
            st = gen.stats
            rep = TurnReport(turn=i, user=user, reply=reply, prompt_tokens=st.prompt_tokens,
                             cached_tokens=st.cached_tokens, cached_blocks_by_tier=dict(st.cached_blocks_by_tier),
                             computed_tokens=st.computed_tokens, stored_blocks=st.stored_blocks,
                             new_tokens=st.new_tokens, ttft_s=st.ttft_s, ttft_recompute_s=ref.stats.ttft_s,
                             decode_tokens_per_s=st.decode_tokens_per_s, touches=st.touches,
                             matches_recompute=matches)
            reports.append(rep)
            if on_turn is not None:
                on_turn(rep)
        stats = lm.client.stats()
    return reports, stats


def format_turn(r: TurnReport) -> str:
    """Human-readable lines for one turn."""
    tiers = ", ".join(f"{n} {t}" for t, n in sorted(r.cached_blocks_by_tier.items())) or "miss"
    check = {None: "", True: "  same reply as recompute", False: "  REPLY DIFFERS FROM RECOMPUTE"}
    return (f"turn {r.turn}: prompt {r.prompt_tokens} tokens, {r.cached_tokens} from tierkv "
            f"(blocks: {tiers}), {r.computed_tokens} computed\n"
            f"  TTFT {r.ttft_s * 1e3:7.0f} ms with tierkv | {r.ttft_recompute_s * 1e3:7.0f} ms recomputing "
            f"| {r.speedup:5.1f}x | decode {r.decode_tokens_per_s:5.1f} tok/s | stored {r.stored_blocks} "
            f"blocks{check[r.matches_recompute]}\n"
            f"  user:      {r.user}\n"
            f"  assistant: {r.reply}\n")


def format_tier_stats(stats: dict[str, Any]) -> str:
    """One line per tier from a daemon stats reply."""
    from tierkv.core.units import format_size

    lines = ["tier stats:"]
    for name, d in stats.get("tiers", {}).items():
        lines.append(f"  {name:5s} {d.get('blocks', 0):5d} blocks  used {format_size(d.get('used_bytes', 0)):>9s}"
                     f" of {format_size(d.get('capacity_bytes', 0)):>9s}  hits {d.get('hits', 0):5d}  "
                     f"misses {d.get('misses', 0):5d}  in {format_size(d.get('bytes_in', 0)):>9s}  "
                     f"out {format_size(d.get('bytes_out', 0)):>9s}")
    return "\n".join(lines)


@click.command("demo")
@click.option("--engine", type=click.Choice(["vllm", "transformers"]), default="vllm", show_default=True,
              help="vllm: vLLM's OpenAI server with tierkv as its KV connector; transformers: tierkv's own loop.")
@click.option("--socket", help="Daemon socket path.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one object per turn.")
@click.option("--turns", type=click.IntRange(min=1), default=None, help="Run only the first N turns.")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False),
              help="User turns, one per line (default: the built-in script).")
@click.option("--max-new-tokens", type=click.IntRange(1, 512), default=32, show_default=True,
              help="Reply length cap per turn.")
@click.option("--check", is_flag=True, help="Also generate each reply without tierkv and compare.")
def demo(engine: str, socket: str | None, as_json: bool, turns: int | None, prompt_file: str | None,
         max_new_tokens: int, check: bool) -> None:
    """Run a multi-turn chat with SmolLM2-135M against a running daemon, showing prefix reuse."""
    script = read_turns(prompt_file)
    if turns is not None:
        if turns > len(script):
            raise click.BadParameter(f"only {len(script)} turns are available", param_hint="--turns")
        script = script[:turns]
    if engine == "vllm":
        _demo_vllm(socket, script, as_json, max_new_tokens)
        return
    out = sys.stderr if as_json else sys.stdout
    t0 = time.perf_counter()
    reports, stats = run_chat(socket, script, max_new_tokens=max_new_tokens, check=check,
                       on_turn=None if as_json else (lambda r: click.echo(format_turn(r))), progress=out)
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in reports], indent=2))
        return
    click.echo(format_tier_stats(stats))
    click.echo(f"{len(reports)} turns in {time.perf_counter() - t0:.1f} s")
    if check and not all(r.matches_recompute for r in reports):
        sys.exit(1)


def _demo_vllm(socket: str | None, script: list[str], as_json: bool, max_new_tokens: int) -> None:
    import tempfile

    from _demo_model import ensure_converted
    from demo_vllm import format_vllm_turn, run_vllm_chat

    from tierkv.client.admin import request
    from tierkv.core.paths import default_socket

    sock = socket or default_socket()
    try:
        request(sock, "PING")  # no daemon: one line, before vLLM spends a minute starting
    except TierKVError as exc:
        raise click.ClickException(str(exc)) from None
    with tempfile.TemporaryDirectory(prefix="tierkv-demo-") as logs:
        out = sys.stderr if as_json else sys.stdout
        try:
            reports = run_vllm_chat(str(ensure_converted(out=out)), sock, script, Path(logs),
                                    max_tokens=max_new_tokens,
                                    on_turn=None if as_json else (lambda r: click.echo(format_vllm_turn(r))),
                                    on_event=lambda m: click.echo(m, err=as_json))
        except RuntimeError as exc:  # vLLM did not start; the message carries its log's tail
            raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in reports], indent=2))
    if not all(r.same_reply for r in reports):
        sys.exit(1)


if __name__ == "__main__":
    demo()

"""Write a generated multi-turn chat trace (Mooncake format) for `tierkv replay`.

    python tools/gen_chat_trace.py --out chat.jsonl --seed 0
    tierkv replay chat.jsonl --policy lru,default --capacity 2%,5%,10%
"""

from __future__ import annotations

import click

from tierkv.sim.chat_trace import ChatTraceSpec, lines


@click.command()
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output .jsonl path.")
@click.option("--conversations", default=800, show_default=True, type=click.IntRange(1))
@click.option("--rate", default=1.0, show_default=True, type=click.FloatRange(min=1e-9),
              help="Conversation starts per second.")
@click.option("--mean-turns", default=5.0, show_default=True, type=click.FloatRange(1.0))
@click.option("--think-s", default=40.0, show_default=True, type=click.FloatRange(0.0),
              help="Mean seconds between a reply and the next turn.")
@click.option("--seed", default=0, show_default=True, type=int)
def main(out: str, conversations: int, rate: float, mean_turns: float, think_s: float, seed: int) -> None:
    """Generate the trace and print how many requests it has."""
    spec = ChatTraceSpec(conversations=conversations, rate_per_s=rate, mean_turns=mean_turns,
                         think_s=think_s, seed=seed)
    n = 0
    with open(out, "w", encoding="utf-8") as fh:
        for text in lines(spec):
            fh.write(text + "\n")
            n += 1
    click.echo(f"{out}: {n} requests from {conversations} conversations (seed {seed})")


if __name__ == "__main__":
    main()

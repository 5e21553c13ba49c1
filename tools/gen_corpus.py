"""Write the generated traces of the corpus (Mooncake format) for `tierkv replay`.

    python tools/gen_corpus.py --out corpus/ --seed 0       # chat, chat-idle, rag, agent, returns .jsonl
    tierkv replay corpus/rag.jsonl --policy lru,default --capacity 2% --disk-capacity 30%
"""

from __future__ import annotations

from pathlib import Path

import click

from tierkv.sim.corpus import NAMES, generated
from tierkv.sim.gen_common import json_lines


@click.command()
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--seed", default=0, show_default=True, type=int)
def main(out: str, seed: int) -> None:
    """Write each generated corpus trace and print how many requests it has."""
    Path(out).mkdir(parents=True, exist_ok=True)
    for name in NAMES:
        if name == "synthetic":
            continue
        path = Path(out) / f"{name}.jsonl"
        rows = generated(name, seed)
        path.write_text("\n".join(json_lines(rows)) + "\n", encoding="utf-8")
        click.echo(f"{path}: {len(rows)} requests (seed {seed})")


if __name__ == "__main__":
    main()

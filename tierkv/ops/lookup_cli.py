"""``tierkv lookup``: how many leading tokens of a prompt each tier holds, for a router.

The prompt's token ids are keyed in the namespace of a connected engine of ``--model`` (its layout,
dtype and TP rank as the daemon lists them in its stats), as the engine's connector keys them.
"""

from __future__ import annotations

import json
import sys

import click

from tierkv.client.admin import request
from tierkv.core.errors import BadRequest
from tierkv.core.layout import Layout
from tierkv.core.prefix import parse_token_ids, tier_tokens


def namespace_of(stats: dict, model: str, tp_rank: int, identity: str | None = None) -> dict:
    """The namespace the daemon lists for ``model`` at ``tp_rank`` (and ``identity``, or a prefix of it).

    Raises:
        BadRequest: no connected engine serves that model (the daemon lists live namespaces only), or
            engines of several identities do and ``identity`` does not choose one.
    """
    found = {ns.get("identity", ""): ns for ns in stats.get("namespaces", {}).values()
             if ns["model"] == model and ns["tp_rank"] == tp_rank
             and (not identity or ns.get("identity", "").startswith(identity))}
    if not found:
        known = sorted({ns["model"] for ns in stats.get("namespaces", {}).values()})
        raise BadRequest(f"no connected engine serves model {model!r} at TP rank {tp_rank}"
                         + (f" with identity {identity}" if identity else "")
                         + f" (connected: {', '.join(known) or 'none'})")
    if len(found) > 1:
        raise BadRequest(f"model {model!r} is served under {len(found)} identities "
                         f"({', '.join(sorted(i[:16] for i in found))}): pass --identity")
    return next(iter(found.values()))


@click.command()
@click.argument("tokens", required=False)
@click.option("--model", required=True, help="The model id the engine's connector registered.")
@click.option("--tp-rank", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--identity", help="The model's identity (or its first characters), where engines of several "
                                 "identities serve the model id (tierkv stats lists them).")
@click.option("--socket", help="Daemon socket path.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def lookup(tokens: str | None, model: str, tp_rank: int, identity: str | None, socket: str | None,
           as_json: bool) -> None:
    """How many leading tokens of TOKENS (token ids; standard input when absent) tierkv holds, and in
    which tier: what a router scores an instance by."""
    from tierkv.client.client import Client

    try:
        ids = parse_token_ids(tokens if tokens is not None else sys.stdin.read())
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    ns = namespace_of(request(socket, "STATS"), model, tp_rank, identity)
    layout = Layout.from_dict(ns["layout"])
    with Client.connect(socket, model=model, layout=layout, tp_rank=tp_rank, tp_size=int(ns.get("tp_size", 1)),
                        identity=ns.get("identity", ""), populate=False, lookup_index=False) as c:
        keys = c.block_keys(ids)
        tiers = c.lookup_tiers(keys) if keys else []
    out = tier_tokens(tiers, layout.block_tokens, len(ids))
    if as_json:
        click.echo(json.dumps(out))
        return
    held = ", ".join(f"{t} {n}" for t, n in out["tiers"].items() if n) or "none"
    click.echo(f"{out['cached_tokens']} of {len(ids)} tokens cached ({held})")

"""``tierkv control``: the operator's commands on a running daemon's control API (pin, unpin, warm, delete
a prompt's prefix; warm a saved prompt list; delete a tenant's blocks; quotas; status), through
:class:`~tierkv.client.control_api.ControlClient`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from tierkv.client.control_api import ControlClient
from tierkv.core.prefix import parse_token_ids
from tierkv.core.units import parse_size

_OPS = ("pin", "unpin", "warm", "delete")
_READS = ("status", "tenants")
_WARM_BATCH = 32  # prompts a warm request of a prompt list names: progress is printed after each


@click.command()
@click.argument("op", type=click.Choice([*_READS, "quotas", *_OPS]))
@click.argument("tokens", required=False)
@click.option("--addr", required=True, help="The daemon's metrics address (server.metrics_addr), HOST:PORT or PORT.")
@click.option("--token-file", help="The bearer token's file (server.control_token_file); needed but for status.")
@click.option("--model", help="The model id the engines registered (every TP rank's namespace).")
@click.option("--salt", help="The tenant's cache_salt (its prefixes are keyed apart).")
@click.option("--identity", help="The model's identity (or its first characters) where several serve the model id.")
@click.option("--priority", default=80, show_default=True, type=click.IntRange(1, 100), help="pin: retention priority.")
@click.option("--tier", type=click.Choice(["host", "disk"]), default="host", show_default=True,
              help="pin, unpin: keep the blocks in host memory or on disk.")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False),
              help="warm: a saved prompt list, one prompt's token ids a line (a JSON list, or an object with "
                   "'tokens' or 'prompt_token_ids'); progress on standard error.")
@click.option("--force", is_flag=True, help="delete: pinned blocks too.")
@click.option("--tiers", help="delete: only these tiers' copies (gpu,host,disk,remote; default all).")
@click.option("--all", "everything", is_flag=True, help="delete: every block of the model's namespaces (no TOKENS).")
@click.option("--tenant", help="quotas: the tenant (the requests' cache_salt); delete: every block it stored "
                               "(of --model, or of every model without it).")
@click.option("--host", "host_quota", help="quotas: the tenant's host bytes, e.g. 8GiB ('none': no quota).")
@click.option("--disk", "disk_quota", help="quotas: the tenant's disk bytes ('none': no quota).")
def control(op: str, tokens: str | None, addr: str, token_file: str | None, model: str | None, salt: str | None,
            identity: str | None, priority: int, tier: str, prompts_file: str | None, force: bool, tiers: str | None,
            everything: bool, tenant: str | None, host_quota: str | None, disk_quota: str | None) -> None:
    """OP the daemon at --addr and print the reply as JSON: read its status or tenants; set a tenant's
    quotas; pin, unpin, warm or delete the prefix of TOKENS (token ids as a JSON list or separated by
    commas; standard input when absent); warm --prompts FILE; delete --tenant T."""
    ctl = ControlClient(addr, token_file=token_file)
    if op in _READS:
        out = ctl.status() if op == "status" else ctl.tenants()
    elif op == "quotas":
        if not tenant or (host_quota is None and disk_quota is None):
            raise click.UsageError("quotas needs --tenant and --host and/or --disk")
        limits = {tier: None if v.lower() == "none" else parse_size(v)
                  for tier, v in (("host", host_quota), ("disk", disk_quota)) if v is not None}
        out = ctl.set_quota(tenant, **limits)
    elif op == "delete" and tenant is not None:
        if tokens is not None or everything:
            raise click.UsageError("delete --tenant takes no TOKENS and no --all")
        out = ctl.delete(model, None, None, identity, force, tiers.split(",") if tiers else None, tenant=tenant)
    elif op == "warm" and prompts_file is not None:
        if not model or tokens is not None:
            raise click.UsageError("warm --prompts needs --model and no TOKENS")
        out = _warm_list(ctl, model, salt, identity, _read_prompts(Path(prompts_file)))
    else:
        if not model:
            raise click.UsageError(f"{op} needs --model")
        if everything and (op != "delete" or tokens is not None):
            raise click.UsageError("--all is for delete, without TOKENS")
        ids = None if everything else parse_token_ids(tokens if tokens is not None else sys.stdin.read())
        if op == "delete":
            out = ctl.delete(model, ids, salt, identity, force, tiers.split(",") if tiers else None)
        elif ids is None:
            raise click.UsageError(f"{op} needs TOKENS")
        elif op == "pin":
            out = ctl.pin(model, ids, salt, identity, priority, tier)
        elif op == "unpin":
            out = ctl.unpin(model, ids, salt, identity, tier)
        else:
            out = ctl.warm(model, ids, salt, identity)
    click.echo(json.dumps(out))


def _read_prompts(path: Path) -> list[list[int]]:
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            ids = row if isinstance(row, list) else row.get("tokens", row.get("prompt_token_ids"))
            prompts.append(parse_token_ids(json.dumps(ids)))
        except (ValueError, AttributeError):
            raise click.UsageError(f"{path}:{n}: not a prompt's token ids (a JSON list, or an object with "
                                   "'tokens' or 'prompt_token_ids')") from None
    if not prompts:
        raise click.UsageError(f"{path} holds no prompt")
    return prompts


def _warm_list(ctl: ControlClient, model: str, salt: str | None, identity: str | None,
               prompts: list[list[int]]) -> dict:
    """Warm ``prompts`` a batch at a time, progress on standard error; the summed result."""
    total: dict = {"warmed": 0, "already": 0, "from": {}, "missing": 0, "prompts": 0, "bytes": 0, "seconds": 0.0}
    for i in range(0, len(prompts), _WARM_BATCH):
        r = ctl.warm(model, None, salt, identity, prompts=prompts[i:i + _WARM_BATCH])
        for k in ("warmed", "already", "missing", "prompts", "bytes", "seconds"):
            total[k] += r[k]
        for tier, n in r["from"].items():
            total["from"][tier] = total["from"].get(tier, 0) + n
        click.echo(f"warm: {total['prompts']}/{len(prompts)} prompts, {total['warmed']} blocks brought up, "
                   f"{total['already']} in host memory, {total['missing']} not cached", err=True)
    total["seconds"] = round(total["seconds"], 4)
    return total

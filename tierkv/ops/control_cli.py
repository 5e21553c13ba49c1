"""``tierkv control``: the operator's commands on a running daemon's control API (pin, unpin, warm, delete
a prompt's prefix; status), through :class:`~tierkv.client.control_api.ControlClient`."""

from __future__ import annotations

import json
import sys

import click

from tierkv.client.control_api import ControlClient
from tierkv.core.prefix import parse_token_ids
from tierkv.core.units import parse_size

_OPS = ("pin", "unpin", "warm", "delete")
_READS = ("status", "tenants")


@click.command()
@click.argument("op", type=click.Choice([*_READS, "quotas", *_OPS]))
@click.argument("tokens", required=False)
@click.option("--addr", required=True, help="The daemon's metrics address (server.metrics_addr), HOST:PORT or PORT.")
@click.option("--token-file", help="The bearer token's file (server.control_token_file); needed but for status.")
@click.option("--model", help="The model id the engines registered (every TP rank's namespace).")
@click.option("--salt", help="The tenant's cache_salt (its prefixes are keyed apart).")
@click.option("--identity", help="The model's identity (or its first characters) where several serve the model id.")
@click.option("--priority", default=80, show_default=True, type=click.IntRange(1, 100), help="pin: retention priority.")
@click.option("--force", is_flag=True, help="delete: pinned blocks too.")
@click.option("--tiers", help="delete: only these tiers' copies (gpu,host,disk,remote; default all).")
@click.option("--all", "everything", is_flag=True, help="delete: every block of the model's namespaces (no TOKENS).")
@click.option("--tenant", help="quotas: the tenant (the requests' cache_salt).")
@click.option("--host", "host_quota", help="quotas: the tenant's host bytes, e.g. 8GiB ('none': no quota).")
@click.option("--disk", "disk_quota", help="quotas: the tenant's disk bytes ('none': no quota).")
def control(op: str, tokens: str | None, addr: str, token_file: str | None, model: str | None, salt: str | None,
            identity: str | None, priority: int, force: bool, tiers: str | None, everything: bool,
            tenant: str | None, host_quota: str | None, disk_quota: str | None) -> None:
    """OP the daemon at --addr and print the reply as JSON: read its status or tenants; set a tenant's
    quotas; pin, unpin, warm or delete the prefix of TOKENS (token ids as a JSON list or separated by
    commas; standard input when absent)."""
    ctl = ControlClient(addr, token_file=token_file)
    if op in _READS:
        out = ctl.status() if op == "status" else ctl.tenants()
    elif op == "quotas":
        if not tenant or (host_quota is None and disk_quota is None):
            raise click.UsageError("quotas needs --tenant and --host and/or --disk")
        limits = {tier: None if v.lower() == "none" else parse_size(v)
                  for tier, v in (("host", host_quota), ("disk", disk_quota)) if v is not None}
        out = ctl.set_quota(tenant, **limits)
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
            out = ctl.pin(model, ids, salt, identity, priority)
        else:
            out = getattr(ctl, op)(model, ids, salt, identity)
    click.echo(json.dumps(out))

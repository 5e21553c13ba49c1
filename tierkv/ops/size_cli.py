"""``tierkv size``: a model's KV footprint, and what of it fits in each tier of a running daemon."""

from __future__ import annotations

import json
from pathlib import Path

import click

from tierkv.core.units import format_size
from tierkv.ops.sizing import PRESETS, Footprint, ModelShape, footprint, from_hf_config, preset, tier_fit


def _shape(model: str | None, layers: int | None, kv_heads: int | None, head_dim: int | None,
           heads: int | None, dtype: str | None, window: int | None, sliding_layers: int | None,
           latent_dim: int | None = None) -> ModelShape:
    """The model from a preset, a config.json, or the geometry flags (flags override either)."""
    if model is None:
        if latent_dim and layers:
            kv_heads, head_dim = kv_heads or 1, head_dim or latent_dim
        if layers is None or kv_heads is None or head_dim is None:
            raise click.UsageError("give a MODEL (preset or config.json) or --layers, --kv-heads and --head-dim "
                                   "(or --layers and --latent-dim)")
        base = ModelShape("custom", layers, kv_heads, head_dim)
    elif model.endswith(".json") or Path(model).is_dir():
        base = from_hf_config(model)
    else:
        base = preset(model)
    for what, v in (("--layers", layers), ("--kv-heads", kv_heads), ("--head-dim", head_dim),
                    ("--sliding-window", window), ("--sliding-layers", sliding_layers), ("--heads", heads),
                    ("--latent-dim", latent_dim)):
        if v is not None and v < (0 if what.startswith("--sliding") else 1):
            raise click.BadParameter(f"must be > 0, got {v}", param_hint=what)
    from dataclasses import replace

    from tierkv.core.layout import dtype_name

    shape = replace(base, num_layers=layers or base.num_layers, num_kv_heads=kv_heads or base.num_kv_heads,
                    head_dim=head_dim or base.head_dim, num_heads=heads or base.num_heads,
                    dtype=dtype_name(dtype) if dtype else base.dtype)
    if latent_dim is not None:
        shape = replace(shape, latent_dim=latent_dim)
    if window is not None:
        shape = replace(shape, sliding_window=window,
                        sliding_layers=shape.sliding_layers or (shape.num_layers if window else 0))
    if sliding_layers is not None:
        shape = replace(shape, sliding_layers=min(sliding_layers, shape.num_layers))
    if not shape.sliding_window:
        shape = replace(shape, sliding_layers=0)
    return shape


@click.command()
@click.argument("model", required=False)
@click.option("--layers", type=int, help="Transformer layers.")
@click.option("--kv-heads", type=int, help="Key/value heads (1: MQA; fewer than --heads: GQA).")
@click.option("--heads", type=int, help="Query heads (only labels MHA/GQA/MQA).")
@click.option("--head-dim", type=int, help="Channels per head.")
@click.option("--dtype", help="KV dtype: bfloat16, float16, float32, fp8.")
@click.option("--sliding-window", "window", type=int, help="Sliding-window tokens (0: none).")
@click.option("--sliding-layers", type=int, help="Layers using the window (default: all when a window is set).")
@click.option("--latent-dim", type=int, help="MLA: cached latent width, kv_lora_rank + rope dims (no V).")
@click.option("--block-tokens", type=int, default=16, show_default=True, help="Tokens per block.")
@click.option("--seq-len", type=int, default=4096, show_default=True, help="Tokens per sequence.")
@click.option("--batch", type=int, default=1, show_default=True, help="Sequences per batch.")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel ranks (sizes per rank).")
@click.option("--codec", default="raw", show_default=True, help="Disk codec: raw, lossless, zstd, fp8, int8, int4.")
@click.option("--socket", help="Also show what fits in each tier of the daemon on this socket.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (byte counts as integers).")
def size(model: str | None, layers: int | None, kv_heads: int | None, heads: int | None, head_dim: int | None,
         dtype: str | None, window: int | None, sliding_layers: int | None, latent_dim: int | None,
         block_tokens: int, seq_len: int, batch: int, tp: int, codec: str, socket: str | None, as_json: bool) -> None:
    """KV bytes per token, block, sequence and batch of MODEL: a preset (see below), a Hugging Face
    config.json (or its directory), or the geometry flags.

    Presets: """
    shape = _shape(model, layers, kv_heads, head_dim, heads, dtype, window, sliding_layers, latent_dim)
    fp = footprint(shape, block_tokens=block_tokens, seq_len=seq_len, batch=batch, codec=codec, tp=tp)
    fit = None
    if socket is not None:
        from tierkv.client.admin import request

        st = request(socket, "STATS")
        disk_codec = st["tiers"].get("disk", {}).get("codec", "lossless")
        fit = tier_fit(fp, st["tiers"], disk_codec)
    if as_json:
        out = fp.to_dict()
        if fit is not None:
            out["tiers"] = fit
        click.echo(json.dumps(out, sort_keys=True))
        return
    _print(fp, fit)


size.help = (size.help or "") + ", ".join(p.name for p in PRESETS.values()) + " (gemma-3 = Gemma-3-27B)."


def _print(fp: Footprint, fit: dict[str, dict] | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    window = (f", {fp.sliding_layers} of {fp.num_layers} layers slide over {fp.sliding_window} tokens"
              if fp.sliding_window else "")
    geometry = (f"a {fp.head_dim}-wide latent (no V)" if fp.attention == "MLA"
                else f"{fp.num_kv_heads} KV heads x {fp.head_dim} dims")
    console.print(f"[bold]{fp.model}[/]: {fp.num_layers} layers x {geometry}, {fp.attention}, {fp.dtype}{window}",
                  soft_wrap=True)
    t = Table(show_header=True, box=None, pad_edge=False)
    t.add_column("per", style="bold")
    t.add_column("bytes", justify="right")
    t.add_column("", justify="right", style="dim")
    rows = [("token", fp.bytes_per_token, ""),
            (f"block ({fp.block_tokens} tokens)", fp.bytes_per_block, f"slot {format_size(fp.slot_bytes_per_block)}"),
            (f"block on disk ({fp.codec})", fp.stored_bytes_per_block,
             f"{fp.bytes_per_block / fp.stored_bytes_per_block:.2f}x" if fp.codec not in ("raw", "lossless", "zstd")
             else "upper bound" if fp.codec != "raw" else ""),
            (f"sequence ({fp.seq_len} tokens)", fp.bytes_per_sequence, f"{fp.blocks_per_sequence} blocks"),
            (f"batch ({fp.batch} sequence{'s' if fp.batch != 1 else ''})", fp.bytes_per_batch, "")]
    for name, n, note in rows:
        t.add_row(name, format_size(n), note)
    console.print(t)
    if fit:
        f = Table(title="fits in the daemon's tiers", title_justify="left")
        for c in ("tier", "capacity", "per block", "blocks", "tokens", f"sequences of {fp.seq_len}", "free blocks"):
            f.add_column(c, justify="left" if c == "tier" else "right")
        for name, d in fit.items():
            f.add_row(name, format_size(d["capacity_bytes"]), format_size(d["bytes_per_block"]), f"{d['blocks']:,}",
                      f"{d['tokens']:,}", f"{d['sequences']:,}", f"{d['free_blocks']:,}")
        console.print(f)

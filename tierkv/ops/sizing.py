"""KV-cache footprint of a model: bytes per token, block, sequence and batch (``tierkv size``).

K and V of every layer are kept per token: ``2 x layers x kv_heads x head_dim x itemsize`` bytes. GQA and
MQA shrink ``kv_heads``; a sliding-window layer keeps at most ``window`` tokens of a sequence; multi-head
latent attention (MLA: DeepSeek-V2/V3, Kimi) keeps one latent vector per token and layer, no V:
``layers x latent_dim x itemsize`` bytes, whatever the heads. tierkv
stores whole blocks (every layer of ``block_tokens`` tokens), in a 4 KiB-aligned slot in memory tiers and
encoded by the disk codec on disk.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tierkv.core.layout import Layout, dtype_name


@dataclass(frozen=True)
class ModelShape:
    """The KV geometry of a model, as far as the cache size depends on it."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int = 0
    """Query heads (0: unknown); with ``num_kv_heads`` it tells MHA, GQA and MQA apart."""
    dtype: str = "bfloat16"
    sliding_window: int = 0
    """Tokens a sliding-window layer attends to (0: none)."""
    sliding_layers: int = 0
    """How many of the layers use the sliding window."""
    latent_dim: int = 0
    """MLA: the cached latent width, ``kv_lora_rank + qk_rope_head_dim`` (0: K and V per head)."""

    def attention(self) -> str:
        """``MLA``, ``MHA``, ``MQA`` or ``GQA n:1``."""
        if self.latent_dim:
            return "MLA"
        if self.num_kv_heads == 1:
            return "MQA"
        if not self.num_heads or self.num_heads == self.num_kv_heads:
            return "MHA" if self.num_heads else "-"
        return f"GQA {self.num_heads // self.num_kv_heads}:1"


def _gemma3(name: str, layers: int, heads: int, kv: int, head_dim: int, window: int) -> ModelShape:
    # five sliding-window layers to one global layer
    return ModelShape(name, layers, kv, head_dim, heads, "bfloat16", window, layers - layers // 6)


PRESETS: dict[str, ModelShape] = {p.name.lower(): p for p in (
    ModelShape("Llama-3-8B", 32, 8, 128, 32),
    ModelShape("Llama-3-70B", 80, 8, 128, 64),
    ModelShape("Mixtral-8x7B", 32, 8, 128, 32),
    ModelShape("TinyLlama-1.1B", 22, 4, 64, 32),
    ModelShape("SmolLM2-135M", 30, 3, 64, 9),
    ModelShape("Qwen2.5-7B", 28, 4, 128, 28),
    _gemma3("Gemma-3-1B", 26, 4, 1, 256, 512),
    _gemma3("Gemma-3-4B", 34, 8, 4, 256, 1024),
    _gemma3("Gemma-3-12B", 48, 16, 8, 256, 1024),
    _gemma3("Gemma-3-27B", 62, 32, 16, 128, 1024),
    ModelShape("DeepSeek-V2-Lite", 27, 1, 576, 16, latent_dim=576),
    ModelShape("DeepSeek-V3", 61, 1, 576, 128, latent_dim=576),
)}
ALIASES = {"gemma-3": "gemma-3-27b", "llama-3.1-8b": "llama-3-8b", "llama-3.1-70b": "llama-3-70b"}


def preset(name: str) -> ModelShape:
    """A preset by name (case-insensitive).

    Raises:
        ValueError: unknown name (the message lists the presets).
    """
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        raise ValueError(f"unknown model {name!r} (presets: {', '.join(p.name for p in PRESETS.values())}; "
                         "or give a config.json, or --layers --kv-heads --head-dim)")
    return PRESETS[key]


def from_hf_config(path: str | Path) -> ModelShape:
    """Read a Hugging Face ``config.json`` (or a directory holding one); multimodal ``text_config`` too.

    Raises:
        ValueError: unreadable file or a config without the attention fields.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {p}: {getattr(exc, 'strerror', None) or exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p} is not a JSON object")
    top, cfg = cfg, cfg.get("text_config") or cfg
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        raise ValueError(f"{p}: needs num_hidden_layers, num_attention_heads and head_dim or hidden_size") from None
    window, sliding = _hf_window(cfg, layers)
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    name = top.get("_name_or_path") or p.parent.name or (top.get("architectures") or ["model"])[0]
    latent = int(cfg.get("kv_lora_rank") or 0)
    if latent:  # MLA: one latent of kv_lora_rank + the rope part per token and layer
        latent += int(cfg.get("qk_rope_head_dim") or 0)
        kv, head_dim = 1, latent
    return ModelShape(str(name), layers, kv, head_dim, heads, dtype_name(dtype), window, sliding, latent)


def _hf_window(cfg: dict[str, Any], layers: int) -> tuple[int, int]:
    """(window, sliding layers) from the config's ``layer_types``, ``sliding_window_pattern`` or flags."""
    window = cfg.get("sliding_window") or 0
    if not window or cfg.get("use_sliding_window") is False:
        return 0, 0
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        return int(window), sum(1 for t in types if "sliding" in str(t))
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 0:
        return int(window), layers - layers // pattern
    return int(window), layers


@dataclass
class Footprint:
    """What ``tierkv size --json`` prints; every byte count a plain int."""

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    attention: str
    """``MHA``, ``GQA n:1``, ``MQA`` or ``MLA`` (then ``head_dim`` is the latent width, one head, no V)."""
    dtype: str
    block_tokens: int
    seq_len: int
    batch: int
    sliding_window: int
    sliding_layers: int
    bytes_per_token: int
    bytes_per_block: int
    blocks_per_sequence: int
    bytes_per_sequence: int
    """KV the engine keeps for one sequence of ``seq_len`` tokens (sliding layers capped at the window)."""
    bytes_per_batch: int
    codec: str
    stored_bytes_per_block: int
    """One block as the disk tier stores it with ``codec`` (an upper bound for lossless codecs)."""
    slot_bytes_per_block: int
    """One block's slot in the host and GPU tiers."""

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return asdict(self)


def footprint(shape: ModelShape, *, block_tokens: int = 16, seq_len: int = 4096, batch: int = 1,
              codec: str = "raw", tp: int = 1) -> Footprint:
    """The footprint of ``shape`` (per tensor-parallel rank when ``tp > 1``).

    Raises:
        ValueError: non-positive sizes, ``tp`` not dividing the KV heads, or an unknown codec.
    """
    for what, v in (("block tokens", block_tokens), ("seq-len", seq_len), ("batch", batch), ("tp", tp)):
        if v <= 0:
            raise ValueError(f"{what} must be > 0")
    layout = shape_layout(shape, block_tokens, tp)
    kv = layout.num_kv_heads
    per_layer_token = layout.planes * kv * layout.head_dim * layout.itemsize
    full_layers = shape.num_layers - shape.sliding_layers
    kept = full_layers * seq_len + shape.sliding_layers * min(seq_len, shape.sliding_window or seq_len)
    from tierkv.tiers.host import slot_size_for

    return Footprint(
        model=shape.name, num_layers=shape.num_layers, num_kv_heads=kv, head_dim=layout.head_dim,
        attention=shape.attention(), dtype=layout.dtype, block_tokens=block_tokens, seq_len=seq_len, batch=batch,
        sliding_window=shape.sliding_window, sliding_layers=shape.sliding_layers,
        bytes_per_token=per_layer_token * shape.num_layers, bytes_per_block=layout.block_bytes,
        blocks_per_sequence=math.ceil(seq_len / block_tokens), bytes_per_sequence=per_layer_token * kept,
        bytes_per_batch=per_layer_token * kept * batch, codec=codec,
        stored_bytes_per_block=encoded_block_bytes(layout, codec),
        slot_bytes_per_block=slot_size_for(layout.block_bytes))


def shape_layout(shape: ModelShape, block_tokens: int, tp: int = 1) -> Layout:
    """The tierkv layout of one rank's blocks of ``shape`` (an MLA latent is the same on every rank).

    Raises:
        ValueError: ``tp`` does not divide the KV heads.
    """
    if shape.latent_dim:
        return Layout(shape.num_layers, 1, shape.latent_dim, block_tokens, shape.dtype, kind="latent")
    if shape.num_kv_heads % tp:
        raise ValueError(f"tp {tp} does not divide the {shape.num_kv_heads} KV heads")
    return Layout(shape.num_layers, shape.num_kv_heads // tp, shape.head_dim, block_tokens, shape.dtype)


def encoded_block_bytes(layout: Layout, codec: str) -> int:
    """Bytes of one block encoded with ``codec``: measured by encoding a random block (quantizing codecs
    have a fixed size); lossless codecs get the raw size, their bound (real KV compresses better).

    Raises:
        ValueError: unknown codec.
    """
    import numpy as np

    from tierkv.codecs import available_codecs, encode_block, get_codec

    if codec not in available_codecs():
        raise ValueError(f"unknown codec {codec!r} (known: {', '.join(available_codecs())})")
    lossy = codec not in ("raw", "lossless", "zstd")
    name = codec if lossy else "raw"
    if lossy and (layout.itemsize == 1 or (getattr(get_codec(codec), "kv_only", False) and layout.kind != "kv")):
        name = "raw"  # stored losslessly: the quantizers take 16- and 32-bit floats, int8/int4 K/V blocks only
    rng = np.random.default_rng(0)
    x = rng.standard_normal(layout.block_elems, dtype=np.float32)
    import torch

    raw = torch.from_numpy(x).to(layout.torch_dtype).view(torch.uint8).numpy()
    return len(encode_block(raw, layout=layout, fingerprint=bytes(16), key=b"k" * 16, codec=name))


def tier_fit(fp: Footprint, tiers: dict[str, dict], disk_codec: str) -> dict[str, dict[str, int]]:
    """Blocks, tokens and sequences of ``fp`` that fit in each tier of a running daemon (its ``stats``):
    in its capacity and in what is free now. Memory tiers hold slots; disk and remote hold encoded blocks."""
    from tierkv.tiers.disk import stored_size

    out = {}
    stored = None
    for name, d in tiers.items():
        if name in ("gpu", "host"):
            per_block = fp.slot_bytes_per_block
        else:
            if stored is None:
                layout = Layout(fp.num_layers, fp.num_kv_heads, fp.head_dim, fp.block_tokens, fp.dtype,
                                kind="latent" if fp.attention == "MLA" else "kv")
                stored = stored_size(encoded_block_bytes(layout, disk_codec))
            per_block = stored
        cap = int(d.get("capacity_bytes", 0))
        free = max(0, cap - int(d.get("used_bytes", 0)))
        blocks = cap // per_block
        out[name] = {"capacity_bytes": cap, "free_bytes": free, "bytes_per_block": per_block, "blocks": blocks,
                     "tokens": blocks * fp.block_tokens, "sequences": blocks // fp.blocks_per_sequence,
                     "free_blocks": free // per_block}
    return out

"""What the tier benchmarks share: the Llama-3-8B block layout, the KV bytes they store, and summaries."""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
import torch

import tierkv

LLAMA = tierkv.Layout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16, dtype="bfloat16")
N = 256
GB = 1e9
SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "data" / "kv-sample"


def kv_blocks(n: int) -> torch.Tensor:
    """Real KV bytes (SmolLM2 keys and values cast to bf16) laid out as ``n`` Llama-3-8B blocks."""
    try:
        k = np.load(SAMPLE / "k.npy", mmap_mode="r")
        v = np.load(SAMPLE / "v.npy", mmap_mode="r")
        flat = torch.from_numpy(np.concatenate([np.asarray(k).reshape(-1), np.asarray(v).reshape(-1)]))
        flat = flat.float().to(torch.bfloat16)
        source = "real SmolLM2 KV (kv-sample) cast to bf16"
    except OSError:
        flat = torch.randn(1 << 22).to(torch.bfloat16)
        source = "random normal bf16 (kv-sample not found)"
    need = n * LLAMA.block_elems
    reps = -(-need // flat.numel())
    out = flat.repeat(reps)[:need].reshape(LLAMA.batch_shape(n)).contiguous()
    kv_blocks.source = source  # type: ignore[attr-defined]
    return out


def best_median(xs: list[float]) -> dict:
    """The best and the median of ``xs`` (GB/s), and every value."""
    return {"best": max(xs), "median": statistics.median(xs), "all": xs}



"""Frozen prefixes on disk: export a cached prefix to a file, and preload + pin it in a daemon.

The file is a plain ``.npz`` (loaded with ``allow_pickle=False``): ``meta`` (JSON: model, identity, layout,
tensor-parallel rank and size), ``token_ids`` (int64) and ``blocks`` (the raw block bytes, uint8
``[n, block_bytes]``). Keys are recomputed from the tokens, so a file is valid for any daemon.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

import numpy as np
import torch

from tierkv.client.client import Client
from tierkv.core.errors import BadRequest
from tierkv.core.layout import Layout


def export_prefix(client: Client, token_ids: Sequence[int] | np.ndarray, path: str | os.PathLike) -> int:
    """Write the cached blocks of ``token_ids`` (full blocks only) to ``path``; returns blocks written.

    Raises:
        KeyMissing: part of the prefix is not cached.
    """
    tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    keys = client.block_keys(tokens)
    blocks = client.get(keys)
    ns = client.namespace
    meta = {"model": ns.model, "identity": ns.identity, "layout": ns.layout.to_dict(), "tp_rank": ns.tp_rank,
            "tp_size": ns.tp_size}
    raw = blocks.reshape(len(keys), -1).view(torch.uint8).numpy()
    with open(path, "wb") as f:
        np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
                 token_ids=tokens[:len(keys) * ns.layout.block_tokens], blocks=raw)
    return len(keys)


PRELOAD_CHUNK = 64  # blocks per put: bounds the memory of one request and paces the progress bar


def preload_file(socket: str | None, path: str | os.PathLike, priority: int = 80,
                 advance: Callable[..., None] | None = None) -> tuple[str, int]:
    """Store and pin the prefix saved in ``path``; returns (model, blocks pinned).

    ``advance(n, total=blocks)`` is called after each chunk of ``n`` blocks is stored (a progress bar)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            tokens, raw = z["token_ids"], z["blocks"]
    except (OSError, ValueError, KeyError) as exc:
        raise BadRequest(f"{path}: not a tierkv prefix file ({exc})") from None
    layout = Layout.from_dict(meta["layout"])
    n = len(tokens) // layout.block_tokens
    if raw.shape != (n, layout.block_bytes) or raw.dtype != np.uint8:
        raise BadRequest(f"{path}: blocks do not match the layout in the file")
    blocks = torch.from_numpy(raw).view(layout.torch_dtype).reshape(layout.batch_shape(n))
    with Client.connect(socket, model=meta["model"], layout=layout, tp_rank=int(meta.get("tp_rank", 0)),
                        tp_size=int(meta.get("tp_size", 1)), identity=str(meta.get("identity", "")),
                        populate=False) as c:
        keys = c.block_keys(tokens)
        for i in range(0, n, PRELOAD_CHUNK):
            c.put(keys[i:i + PRELOAD_CHUNK], blocks[i:i + PRELOAD_CHUNK])
            if advance is not None:
                advance(len(keys[i:i + PRELOAD_CHUNK]), total=n)
        return meta["model"], c.pin_prefix(keys, priority)

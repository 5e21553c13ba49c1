"""What the connector keys KV by besides token ids: the engine's model identity, the adapter a request
runs through, and the images or prompt embeddings its blocks were computed from.

The engine's identity (:func:`engine_identity`) is taken once per process from vLLM's config: the weights
vLLM loaded (a local directory or file, or the hub snapshot it downloaded, at its commit), the config vLLM
runs (overrides applied), its dtype, KV cache dtype and quantization. A model whose weights cannot be
found is not served (the connector stays off with one log line) unless ``identity_override`` asserts
an identity by hand.

Per request (:class:`RequestInputs`): a LoRA adapter is keyed by its own identity (its weights, not its
name: the chain starts from a root of its own, :func:`salt_root`, as a ``cache_salt``'s does),
multimodal items by vLLM's hash of each item and where it sits in the block, prompt embeddings by a
digest of each block's embeddings (both mixed into the block's key). A request with an input that cannot
be identified (an adapter whose files cannot be read, an item without a hash) is neither stored nor loaded.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from tierkv.client.identity import adapter_identity, model_identity
from tierkv.client.weights import MODES, weights_digest
from tierkv.core.keys import salt_root

__all__ = ["AdapterIdentities", "IdentityUnknown", "Inputs", "RequestInputs", "TokensOnly", "engine_identity",
           "request_inputs", "salt_root"]

log = logging.getLogger("vllm.tierkv")


class Inputs(Protocol):
    """What a request's KV depends on besides its token ids (:mod:`~tierkv.integrations.vllm.identity`)."""

    @property
    def adapter(self) -> str | None:
        """The identity of the adapter the request runs through (None: the base model)."""

    def extras(self, first: int, n: int) -> list[bytes | None] | None:
        """Per block ``first .. n - 1``, a digest of its other inputs (None: token ids alone)."""


@dataclass(frozen=True, slots=True)
class TokensOnly:
    """A request keyed by its token ids alone."""

    adapter: str | None = None

    def extras(self, first: int, n: int) -> list[bytes | None] | None:
        """None: token ids alone."""
        return None


class IdentityUnknown(ValueError):
    """The model's (or an input's) identity cannot be established: tierkv must not serve it."""


def _weights_path(model_config: Any, load_config: Any) -> tuple[Path, str | None]:
    """The weights vLLM loaded and the hub commit they came at (None for a local path)."""
    model = str(model_config.model)
    path = Path(model)
    if path.exists():
        return path, None
    try:
        from huggingface_hub import snapshot_download

        snap = snapshot_download(model, revision=getattr(model_config, "revision", None),
                                 cache_dir=getattr(load_config, "download_dir", None), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure means: not identifiable
        raise IdentityUnknown(f"cannot find {model!r} on disk or in the hub cache ({exc})") from None
    return Path(snap), Path(snap).name


def engine_identity(vllm_config: Any, extra: dict[str, Any]) -> str:
    """The identity the connector's namespaces carry.

    ``extra`` is ``kv_connector_extra_config``: ``identity`` (``sampled``, the default, or ``full``) says
    how the weights are digested; ``identity_override`` replaces the identity by a value of its own, which
    asserts that every engine started with that value runs the same weights (dangerous: blocks are then
    served between them whatever their weights are).

    Raises:
        IdentityUnknown: the weights cannot be found, or a setting is bad.
    """
    override = extra.get("identity_override")
    if override is not None:
        if not isinstance(override, str) or not override or len(override) > 200 or not override.isprintable():
            raise IdentityUnknown(f"identity_override must be a non-empty printable string, got {override!r}")
        return f"override:{override}"
    mode = extra.get("identity", "sampled")
    if mode not in MODES:
        raise IdentityUnknown(f"kv_connector_extra_config identity must be one of {MODES}, got {mode!r}")
    mc = vllm_config.model_config
    load_format = str(getattr(vllm_config.load_config, "load_format", "auto"))
    if load_format == "dummy":
        raise IdentityUnknown("--load-format dummy: the weights are random")
    path, revision = _weights_path(mc, vllm_config.load_config)
    try:
        weights = weights_digest(path, mode)
    except (OSError, ValueError) as exc:
        raise IdentityUnknown(f"cannot digest the weights at {path} ({exc})") from None
    hf_config = getattr(mc, "hf_config", None)
    config = hf_config.to_dict() if hf_config is not None and hasattr(hf_config, "to_dict") else {}
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
    return model_identity(weights=weights, config=config, dtype=str(mc.dtype), kv_cache_dtype=cache_dtype,
                          revision=revision, quantization=getattr(mc, "quantization", None),
                          extra={"load_format": load_format})


class AdapterIdentities:
    """Adapter identities by path, taken once per adapter (None: the adapter cannot be identified)."""

    def __init__(self) -> None:
        self._known: dict[str, str | None] = {}

    def of(self, lora_request: Any) -> str | None:
        """The identity of ``lora_request``'s adapter, or None when its files cannot be read."""
        path = str(getattr(lora_request, "lora_path", "") or "")
        if path not in self._known:
            try:
                self._known[path] = adapter_identity(path)
            except (OSError, ValueError) as exc:
                self._known[path] = None
                log.warning("tierkv: requests through adapter %r are not cached: cannot identify it (%s)",
                            getattr(lora_request, "lora_name", path), exc)
        return self._known[path]


@dataclass(frozen=True, slots=True)
class RequestInputs:
    """What a request's KV depends on besides its token ids: its adapter's identity (None: the base model)
    and, per block, a digest of its images or prompt embeddings."""

    adapter: str | None
    request: Any
    block_tokens: int
    mm: bool
    embeds: bool

    def extras(self, first: int, n: int) -> list[bytes | None] | None:
        """Per block ``first .. n - 1``, the digest of what else it was computed from (None: nothing)."""
        if not (self.mm or self.embeds):
            return None
        return [self._extra(i) for i in range(first, n)]

    def _extra(self, i: int) -> bytes | None:
        bt = self.block_tokens
        lo, hi = i * bt, (i + 1) * bt
        h = hashlib.blake2b(digest_size=16)
        used = False
        for f in self.request.mm_features if self.mm else ():
            pos = f.mm_position
            if pos.offset < hi and lo < pos.offset + pos.length:  # the item reaches into the block
                h.update(f"mm|{f.identifier}|{pos.offset - lo}|".encode())
                used = True
        if self.embeds and lo < self.request.prompt_embeds.shape[0]:
            part = self.request.prompt_embeds[lo:hi].detach().contiguous().cpu()
            h.update(b"embeds|")
            h.update(part.reshape(-1).view(torch.uint8).numpy().tobytes())
            used = True
        return h.digest() if used else None


def request_inputs(request: Any, block_tokens: int, adapters: AdapterIdentities) -> RequestInputs:
    """The request's inputs beyond token ids.

    Raises:
        IdentityUnknown: an input cannot be identified (the request is neither stored nor loaded).
    """
    lora = getattr(request, "lora_request", None)
    adapter = None
    if lora is not None:
        adapter = adapters.of(lora)
        if adapter is None:
            raise IdentityUnknown(f"adapter {getattr(lora, 'lora_name', '?')!r} cannot be identified")
    features = list(getattr(request, "mm_features", None) or [])
    if any(not getattr(f, "identifier", None) for f in features):
        raise IdentityUnknown("a multimodal item without a hash")
    embeds = getattr(request, "prompt_embeds", None) is not None
    return RequestInputs(adapter, request, block_tokens, bool(features), embeds)

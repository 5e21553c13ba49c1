"""One contract, run against every registered codec (tierkv.codecs registry).

Each codec round-trips a KV-like block within its declared error bound (``Codec.max_rel_rmse``; 0 is
bit-exact), writes a header that names it, its namespace and its layout, refuses the block under
another namespace, key or layout, and turns every corrupt or truncated blob into a ``CodecError``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv.codecs import CodecError, available_codecs, decode_block, encode_block, get_codec, read_header
from tierkv.codecs.container import MAGIC
from tierkv.core.keys import Namespace
from tierkv.core.layout import Layout

KEY = b"\x07" * 16
OTHER_KEY = b"\x08" * 16
CODECS = available_codecs()
DTYPES = ["bfloat16", "float16", "float32"]


def _layout(dtype: str) -> Layout:
    return Layout(4, 2, 64, 16, dtype)


def _fp(layout: Layout, model: str = "contract-model") -> bytes:
    return Namespace(model, layout).fingerprint


def _kv_block(layout: Layout, seed: int = 0) -> torch.Tensor:
    """Gaussian K and V; K channels scaled log-normally, as real keys have outlier channels."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(layout.block_shape).astype(np.float32)
    x[0] *= rng.lognormal(0.0, 1.0, size=(layout.num_layers, layout.num_kv_heads, 1, layout.head_dim))
    return torch.from_numpy(x).to(layout.torch_dtype).contiguous()


def _decoded(blob: bytes, layout: Layout) -> torch.Tensor:
    out = decode_block(blob, layout=layout, fingerprint=_fp(layout), key=KEY)
    return torch.from_numpy(out).view(layout.torch_dtype).reshape(layout.block_shape)


def _rel_rmse(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.sqrt(((a - b) ** 2).mean() / (a ** 2).mean()))


@pytest.fixture(scope="module", params=CODECS)
def codec_name(request) -> str:
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_within_declared_bound(codec_name, dtype):
    codec = get_codec(codec_name)
    layout = _layout(dtype)
    block = _kv_block(layout)
    blob = encode_block(block, layout=layout, fingerprint=_fp(layout), key=KEY, codec=codec_name)
    back = _decoded(blob, layout)
    assert back.dtype == block.dtype and back.shape == block.shape
    if codec.max_rel_rmse == 0.0:
        assert not codec.lossy
        assert back.view(torch.uint8).numpy().tobytes() == block.view(torch.uint8).numpy().tobytes()
        return
    assert codec.lossy
    a, b = block.float().numpy(), back.float().numpy()
    for half in (0, 1):
        assert _rel_rmse(a[half], b[half]) <= codec.max_rel_rmse, f"{codec_name} {'KV'[half]} error"


def test_a_latent_block_round_trips_and_is_never_read_as_a_kv_block(codec_name):
    """An MLA block (one latent vector per token, no V): the header names its kind; codecs that scale K and V
    apart store it with the lossless fallback; the same bytes under the K/V layout of equal size fail."""
    codec = get_codec(codec_name)
    latent = Layout(4, 1, 128, 16, "bfloat16", kind="latent")
    assert latent.block_shape == (1, 4, 1, 16, 128)
    block = _kv_block(latent, seed=3)
    blob = encode_block(block, layout=latent, fingerprint=_fp(latent), key=KEY, codec=codec_name)
    h = read_header(blob)
    assert h.layout == latent.to_dict() == {**Layout(4, 1, 128, 16, "bfloat16").to_dict(), "kind": "latent"}
    expected = "lossless" if codec_name in ("int8", "int4") else codec_name
    assert h.codec == expected or (expected == "lossless" and h.codec == "raw")  # raw: lossless saved too little
    back = _decoded(blob, latent)
    if h.lossy:
        assert _rel_rmse(block.float().numpy(), back.float().numpy()) <= codec.max_rel_rmse
    else:
        assert torch.equal(back.view(torch.uint8), block.view(torch.uint8))
    kv_same_bytes = Layout(4, 1, 64, 16, "bfloat16")  # [2, 4, 1, 16, 64]: the same byte count
    assert kv_same_bytes.block_bytes == latent.block_bytes
    assert Namespace("m", kv_same_bytes).fingerprint != Namespace("m", Layout(4, 1, 64, 16, "bfloat16",
                                                                                   kind="latent")).fingerprint
    with pytest.raises(CodecError):
        decode_block(blob, layout=kv_same_bytes, fingerprint=_fp(latent), key=KEY)


def test_header_names_codec_namespace_and_layout(codec_name):
    codec = get_codec(codec_name)
    layout = _layout("bfloat16")
    blob = encode_block(_kv_block(layout), layout=layout, fingerprint=_fp(layout), key=KEY, codec=codec_name)
    h = read_header(blob)
    assert (h.codec, h.codec_id, h.lossy) == (codec_name, codec.codec_id, codec.lossy)
    assert h.checksum_scope == ("sections" if codec.lossy else "raw")
    assert h.fingerprint == _fp(layout) and h.layout == layout.to_dict() and h.dtype == layout.dtype
    assert h.raw_len == layout.block_bytes and h.stored_len == len(blob)
    assert h.header_len + sum(s.stored_len for s in h.sections) == len(blob)
    assert blob[:len(MAGIC)] == MAGIC


def test_refuses_another_namespace_key_or_layout(codec_name):
    layout = _layout("bfloat16")
    blob = encode_block(_kv_block(layout), layout=layout, fingerprint=_fp(layout), key=KEY, codec=codec_name)
    with pytest.raises(CodecError, match="namespace"):
        decode_block(blob, layout=layout, fingerprint=_fp(layout, "another-model"), key=KEY)
    with pytest.raises(CodecError, match="checksum"):
        decode_block(blob, layout=layout, fingerprint=_fp(layout), key=OTHER_KEY)
    other = Layout(4, 2, 64, 16, "float16")  # same size, other dtype
    with pytest.raises(CodecError):
        decode_block(blob, layout=other, fingerprint=_fp(layout), key=KEY)


def test_every_flipped_byte_is_a_codec_error(codec_name):
    """A flip anywhere in the header, or at spread payload offsets, is caught: never wrong data, never a crash."""
    layout = _layout("bfloat16")
    blob = encode_block(_kv_block(layout), layout=layout, fingerprint=_fp(layout), key=KEY, codec=codec_name)
    h = read_header(blob)
    rng = np.random.default_rng(1)
    offsets = list(range(h.header_len)) + sorted(rng.choice(np.arange(h.header_len, len(blob)), 48, replace=False))
    for off in offsets:
        bad = bytearray(blob)
        bad[off] ^= 0x5A
        with pytest.raises(CodecError):
            decode_block(bytes(bad), layout=layout, fingerprint=_fp(layout), key=KEY)


def test_every_truncation_is_a_codec_error(codec_name):
    layout = _layout("bfloat16")
    blob = encode_block(_kv_block(layout), layout=layout, fingerprint=_fp(layout), key=KEY, codec=codec_name)
    h = read_header(blob)
    for n in [*range(h.header_len + 1), *np.linspace(h.header_len + 1, len(blob) - 1, 16, dtype=int)]:
        with pytest.raises(CodecError):
            decode_block(blob[:n], layout=layout, fingerprint=_fp(layout), key=KEY)
    with pytest.raises(CodecError):
        decode_block(blob + b"\0", layout=layout, fingerprint=_fp(layout), key=KEY)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.binary(max_size=512), keep=st.integers(0, 96))
def test_garbage_is_a_codec_error(codec_name, junk, keep):
    """Arbitrary bytes, and a real header prefix followed by arbitrary bytes, are a CodecError."""
    layout = _layout("float16")
    blob = encode_block(_kv_block(layout, seed=2), layout=layout, fingerprint=_fp(layout), key=KEY, codec=codec_name)
    for candidate in (junk, MAGIC + junk, blob[:keep] + junk):
        with pytest.raises(CodecError):
            decode_block(candidate, layout=layout, fingerprint=_fp(layout), key=KEY)
        with pytest.raises(CodecError):
            read_header(candidate)

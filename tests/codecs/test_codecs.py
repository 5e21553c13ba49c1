"""Codec round trips on real KV (tierkv/codecs): lossless bit-exact, lossy within documented bounds."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from tierkv.codecs import BlockHeader, CodecError, available_codecs, decode_block, encode_block, read_header
from tierkv.codecs.container import FORMAT_VERSION
from tierkv.core.errors import BadRequest, TierKVError
from tierkv.core.keys import Namespace
from tierkv.core.layout import Layout

KEY = b"\x01" * 16


def _sample_dir() -> Path | None:
    here = Path(__file__).resolve().parents[2]
    for cand in (os.environ.get("TIERKV_KV_SAMPLE"), here.parent / "shared/data/kv-sample",
                 here / "shared/data/kv-sample", Path("/work/shared/data/kv-sample")):
        if cand and (Path(cand) / "k.npy").exists():
            return Path(cand)
    return None


@pytest.fixture(scope="module")
def kv_sample() -> np.ndarray:
    """Real K/V [2, 30 layers, 3 heads, 1024 tokens, 64] as float32 (from the float16 sample)."""
    d = _sample_dir()
    if d is None:
        pytest.skip("kv-sample not found (set TIERKV_KV_SAMPLE)")
    k = np.load(d / "k.npy", mmap_mode="r")
    v = np.load(d / "v.npy", mmap_mode="r")
    return np.stack([k, v]).astype(np.float32)


def _layout(dtype: str, tokens: int = 16) -> Layout:
    return Layout(30, 3, 64, tokens, dtype)


def _blocks(kv: np.ndarray, dtype: str, starts=(0, 256, 1008)) -> list[torch.Tensor]:
    """16-token blocks of the sample in ``dtype`` (bf16 made by casting through float32, as serving does)."""
    td = _layout(dtype).torch_dtype
    return [torch.from_numpy(np.ascontiguousarray(kv[:, :, :, s:s + 16])).to(td).contiguous() for s in starts]


def _fp(layout: Layout) -> bytes:
    return Namespace("SmolLM2-135M", layout).fingerprint


def _rel_rmse(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.sqrt(((a - b) ** 2).mean() / (a ** 2).mean()))


def test_available_codecs():
    assert available_codecs() == ["raw", "zstd", "lossless", "fp8", "int8", "int4"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("codec", ["raw", "zstd", "lossless"])
def test_lossless_codecs_bit_exact_on_real_kv(kv_sample, dtype, codec):
    layout = _layout(dtype)
    for block in _blocks(kv_sample, dtype):
        blob = encode_block(block, layout=layout, fingerprint=_fp(layout), key=KEY, codec=codec)
        out = decode_block(blob, layout=layout, fingerprint=_fp(layout), key=KEY)
        assert out.dtype == np.uint8 and out.shape == (layout.block_bytes,)
        assert out.tobytes() == block.view(torch.uint8).numpy().tobytes()
        h = read_header(blob)
        assert h.stored_len == len(blob) and h.raw_len == layout.block_bytes and h.checksum_scope == "raw"


def test_lossless_ratio_on_real_bf16(kv_sample):
    layout = _layout("bfloat16")
    blocks = _blocks(kv_sample, "bfloat16", starts=range(0, 1024, 128))
    raw = sum(layout.block_bytes for _ in blocks)
    sizes = {c: sum(len(encode_block(b, layout=layout, fingerprint=_fp(layout), key=KEY, codec=c)) for b in blocks)
             for c in ("lossless", "zstd")}
    assert raw / sizes["lossless"] >= 1.3
    assert sizes["zstd"] / sizes["lossless"] >= 1.1


def test_lossless_channel_major_option(kv_sample):
    layout = _layout("bfloat16")
    block = _blocks(kv_sample, "bfloat16")[1]
    blob = encode_block(block, layout=layout, fingerprint=_fp(layout), key=KEY, lossless_channel_major=True)
    assert read_header(blob).params == {"channel_major": True}
    out = decode_block(blob, layout=layout, fingerprint=_fp(layout), key=KEY)
    assert out.tobytes() == block.view(torch.uint8).numpy().tobytes()


def _special_blocks(layout: Layout, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Raw bytes of hard cases for every dtype: random bits (NaN payloads included), constant, zeros,
    NaN/Inf mixed into normal values, denormals."""
    n, size = layout.block_elems, layout.block_bytes
    word = {1: np.uint8, 2: np.uint16, 4: np.uint32}[layout.itemsize]
    cases = {"random": rng.integers(0, 256, size, dtype=np.uint8),
             "zeros": np.zeros(size, np.uint8),
             "constant": np.full(n, 0x3C, word).view(np.uint8)}
    if layout.dtype in ("float32", "float16", "bfloat16"):
        x = rng.standard_normal(n).astype(np.float32)
        x[rng.integers(0, n, 50)] = np.nan
        x[rng.integers(0, n, 50)] = np.inf
        x[rng.integers(0, n, 50)] = -np.inf
        bits = torch.from_numpy(x).to(layout.torch_dtype).view(torch.uint8).numpy().copy()
        if layout.dtype == "bfloat16":  # NaN payloads (quiet, signalling, negative), both infinities, -0
            bits.view(np.uint16)[:7] = [0x7FC1, 0x7F81, 0xFFFF, 0x7F80, 0xFF80, 0x7FFF, 0x8000]
        cases["nan_inf"] = bits
        tiny = {"float32": 1e-42, "float16": 1e-7, "bfloat16": 1e-40}[layout.dtype]
        d = (rng.standard_normal(n) * tiny).astype(np.float32)
        cases["denormal"] = torch.from_numpy(d).to(layout.torch_dtype).view(torch.uint8).numpy().copy()
    return cases


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn", "int8", "uint8"])
@pytest.mark.parametrize("codec", ["lossless", "zstd", "raw", "int8"])
def test_bit_exact_on_special_data(dtype, codec):
    layout = Layout(3, 2, 16, 16, dtype)
    rng = np.random.default_rng(7)
    for name, raw in _special_blocks(layout, rng).items():
        if codec == "int8" and name not in ("random", "nan_inf"):
            continue  # lossy codecs fall back to lossless only for non-finite or non-float blocks
        blob = encode_block(raw, layout=layout, fingerprint=_fp(layout), key=KEY, codec=codec)
        out = decode_block(blob, layout=layout, fingerprint=_fp(layout), key=KEY)
        if codec == "int8" and dtype in ("bfloat16", "float16", "float32") and name == "random":
            continue  # random bits can be finite floats: quantized, not exact
        assert out.tobytes() == raw.tobytes(), (dtype, codec, name)


def test_lossless_stores_raw_when_it_does_not_pay():
    layout = Layout(3, 2, 16, 16, "bfloat16")
    raw = np.random.default_rng(1).integers(0, 256, layout.block_bytes, dtype=np.uint8)
    h = read_header(encode_block(raw, layout=layout, fingerprint=_fp(layout), key=KEY))
    assert h.codec == "raw" and h.payload_len == layout.block_bytes
    zeros = np.zeros(layout.block_bytes, np.uint8)
    h = read_header(encode_block(zeros, layout=layout, fingerprint=_fp(layout), key=KEY))
    assert h.codec == "lossless" and h.ratio > 10  # the mantissa plane was probed and compressed too


def test_lossless_float32_stores_raw_under_a_fifth_saved():
    """Normal float32 values compress about 1.18x (only the exponent byte): stored raw, read as a memcpy;
    float32 with empty low mantissa bytes (upcast bfloat16) compresses and stays lossless."""
    layout = Layout(3, 2, 16, 16, "float32")
    x = np.random.default_rng(0).standard_normal(layout.block_elems).astype(np.float32)
    h = read_header(encode_block(x.view(np.uint8), layout=layout, fingerprint=_fp(layout), key=KEY))
    assert h.codec == "raw" and h.payload_len == layout.block_bytes
    upcast = (x.view(np.uint32) & 0xFFFF0000).view(np.uint8)
    blob = encode_block(upcast, layout=layout, fingerprint=_fp(layout), key=KEY)
    assert read_header(blob).codec == "lossless" and read_header(blob).ratio > 2
    out = decode_block(blob, layout=layout, fingerprint=_fp(layout), key=KEY)
    assert out.tobytes() == upcast.tobytes()


# --- lossy codecs ------------------------------------------------------------------------------------

# Documented bounds (docs/design.md, Codecs): minimum ratio on 16-bit blocks, maximum relative RMSE of K and V.
# Measured on the real sample: fp8 2.35x 2.6%/2.6%, int8 1.94x 0.4%/0.7%, int4 3.17x 3.1%/8.2%.
LOSSY_BOUNDS = {"fp8": (1.95, 0.03, 0.03), "int8": (1.9, 0.006, 0.01), "int4": (3.0, 0.04, 0.09)}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("codec", ["fp8", "int8", "int4"])
def test_lossy_within_bounds_on_real_kv(kv_sample, dtype, codec):
    layout = _layout(dtype)
    min_ratio, max_k, max_v = LOSSY_BOUNDS[codec]
    blocks = _blocks(kv_sample, dtype, starts=range(0, 1024, 256))
    orig, back, stored = [], [], 0
    for block in blocks:
        blob = encode_block(block, layout=layout, fingerprint=_fp(layout), key=KEY, codec=codec)
        h = read_header(blob)
        assert h.codec == codec and h.lossy and h.checksum_scope == "sections"
        stored += len(blob)
        out = decode_block(blob, layout=layout, fingerprint=_fp(layout), key=KEY)
        dec = torch.from_numpy(out).view(layout.torch_dtype).reshape(layout.block_shape)
        assert dec.dtype == block.dtype and dec.shape == block.shape
        orig.append(block.float().numpy())
        back.append(dec.float().numpy())
    a, b = np.stack(orig), np.stack(back)
    assert len(blocks) * layout.block_bytes / stored >= min_ratio
    assert _rel_rmse(a[:, 0], b[:, 0]) <= max_k
    assert _rel_rmse(a[:, 1], b[:, 1]) <= max_v


def _attention(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention outputs [L, H, T, D] using the keys themselves as queries (no real queries here)."""
    scores = k @ k.transpose(-1, -2) / k.shape[-1] ** 0.5
    t = k.shape[2]
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, -1) @ v


def test_int4_attention_outputs_close(kv_sample):
    layout = _layout("bfloat16")
    fp = _fp(layout)
    blocks = _blocks(kv_sample, "bfloat16", starts=range(0, 256, 16))
    dec = [torch.from_numpy(decode_block(encode_block(b, layout=layout, fingerprint=fp, key=KEY, codec="int4"),
                                         layout=layout, fingerprint=fp, key=KEY)).view(torch.bfloat16)
           .reshape(layout.block_shape) for b in blocks]
    orig, back = torch.cat(blocks, dim=3).float(), torch.cat(dec, dim=3).float()
    ref, test = _attention(orig[0], orig[1]), _attention(back[0], back[1])
    cos = torch.nn.functional.cosine_similarity(ref, test, dim=-1)
    assert cos.mean().item() >= 0.99


def test_int8_error_per_element_bound(kv_sample):
    """|x - x'| <= half a step: K steps are per channel, V steps per token, each at most 4.4% above absmax/127."""
    layout = _layout("float32")
    block = _blocks(kv_sample, "float32")[0]
    out = decode_block(encode_block(block, layout=layout, fingerprint=_fp(layout), key=KEY, codec="int8"),
                       layout=layout, fingerprint=_fp(layout), key=KEY)
    x = block.numpy()
    y = out.view(np.float32).reshape(layout.block_shape)
    step_k = np.abs(x[0]).max(axis=2, keepdims=True) / 127 * 2 ** (1 / 16)
    step_v = np.abs(x[1]).max(axis=3, keepdims=True) / 127 * 2 ** (1 / 16)
    assert (np.abs(x[0] - y[0]) <= step_k / 2 * 1.0001 + 1e-12).all()
    assert (np.abs(x[1] - y[1]) <= step_v / 2 * 1.0001 + 1e-12).all()


def test_int4_options(kv_sample):
    layout = _layout("bfloat16")
    block = _blocks(kv_sample, "bfloat16")[0]
    fp = _fp(layout)
    sizes = {}
    for n8 in (0, 2, 30):
        blob = encode_block(block, layout=layout, fingerprint=fp, key=KEY, codec="int4", int4_int8_layers=n8,
                            int4_group=64)
        assert read_header(blob).params == {"int8_layers": n8, "group": 64}
        sizes[n8] = len(blob)
        decode_block(blob, layout=layout, fingerprint=fp, key=KEY)
    assert sizes[0] < sizes[2] < sizes[30]
    with pytest.raises(ValueError):
        encode_block(block, layout=layout, fingerprint=fp, key=KEY, codec="int4", int4_group=48)
    with pytest.raises(ValueError):
        encode_block(block, layout=layout, fingerprint=fp, key=KEY, codec="int4", int4_bits=3)
    # options of other codecs are ignored, so one tier config can carry settings for several codecs
    encode_block(block, layout=layout, fingerprint=fp, key=KEY, codec="int8", int4_int8_layers=4)


def test_lossy_falls_back_to_lossless_for_non_finite_blocks(kv_sample):
    layout = _layout("bfloat16")
    block = _blocks(kv_sample, "bfloat16")[0].clone()
    block[1, 3, 0, 5, 7] = float("inf")
    raw = block.view(torch.uint8).numpy()
    for codec in ("fp8", "int8", "int4"):
        blob = encode_block(block, layout=layout, fingerprint=_fp(layout), key=KEY, codec=codec)
        assert read_header(blob).codec == "lossless"
        assert decode_block(blob, layout=layout, fingerprint=_fp(layout), key=KEY).tobytes() == raw.tobytes()


def test_switching_codec_keeps_old_blocks_readable(kv_sample):
    """A tier switched from lossless to int8 at run time: new writes use int8, old blocks still decode."""
    layout = _layout("bfloat16")
    fp = _fp(layout)
    blocks = _blocks(kv_sample, "bfloat16", starts=(0, 16, 32, 48))
    store: dict[bytes, bytes] = {}
    tier_codec = "lossless"
    for i, block in enumerate(blocks):
        if i == 2:
            tier_codec = "int8"  # `tierkv tune` at run time
        key = bytes([i]) * 16
        store[key] = encode_block(block, layout=layout, fingerprint=fp, key=key, codec=tier_codec)
    assert [read_header(b).codec for b in store.values()] == ["lossless", "lossless", "int8", "int8"]
    for i, (key, blob) in enumerate(store.items()):
        out = decode_block(blob, layout=layout, fingerprint=fp, key=key)
        if i < 2:
            assert out.tobytes() == blocks[i].view(torch.uint8).numpy().tobytes()
        else:
            dec = torch.from_numpy(out).view(torch.bfloat16).reshape(layout.block_shape).float().numpy()
            assert _rel_rmse(blocks[i].float().numpy(), dec) < 0.01


# --- API behaviour ------------------------------------------------------------------------------------

def test_header_fields(kv_sample):
    layout = _layout("bfloat16")
    block = _blocks(kv_sample, "bfloat16")[0]
    blob = encode_block(block, layout=layout, fingerprint=_fp(layout), key=KEY)
    h = read_header(blob)
    assert isinstance(h, BlockHeader)
    assert (h.version, h.codec, h.dtype, h.layout, h.fingerprint) == (FORMAT_VERSION, "lossless", "bfloat16", layout.to_dict(),
                                                                      _fp(layout))
    assert len(h.checksum) == 16 and h.header_len + h.payload_len == len(blob)
    assert [s.method for s in h.sections] == ["zstd", "raw"]
    assert sum(s.stored_len for s in h.sections) == h.payload_len


def test_inputs_and_out_buffers(kv_sample):
    layout = _layout("bfloat16")
    fp = _fp(layout)
    block = _blocks(kv_sample, "bfloat16")[0]
    raw = block.view(torch.uint8).numpy()
    blobs = [encode_block(x, layout=layout, fingerprint=fp, key=KEY)
             for x in (block, raw, raw.tobytes(), memoryview(raw.tobytes()), raw.view(np.uint16).reshape(2, 30, -1))]
    assert len(set(blobs)) == 1
    blob = blobs[0]
    dst = np.zeros(layout.block_shape, np.uint16)
    assert decode_block(blob, layout=layout, fingerprint=fp, key=KEY, out=dst) is dst
    assert dst.tobytes() == raw.tobytes()
    ba = bytearray(layout.block_bytes)
    assert decode_block(blob, layout=layout, fingerprint=fp, key=KEY, out=ba) is ba and bytes(ba) == raw.tobytes()
    t = torch.empty(layout.block_shape, dtype=torch.bfloat16)
    decode_block(blob, layout=layout, fingerprint=fp, key=KEY, out=t)
    assert torch.equal(t.view(torch.uint16), block.view(torch.uint16))
    for bad in (bytes(layout.block_bytes), bytearray(layout.block_bytes - 1), np.zeros((2, layout.block_bytes), np.uint8)[:, ::2]):
        with pytest.raises(BadRequest):
            decode_block(blob, layout=layout, fingerprint=fp, key=KEY, out=bad)


def test_caller_misuse_raises_value_error(kv_sample):
    layout = _layout("bfloat16")
    fp = _fp(layout)
    raw = _blocks(kv_sample, "bfloat16")[0].view(torch.uint8).numpy()
    with pytest.raises(ValueError, match="unknown codec"):
        encode_block(raw, layout=layout, fingerprint=fp, key=KEY, codec="lz4")
    for kwargs in ({"level": 99}, {"lossless_channel_major": "yes"}, {"turbo": True}):
        with pytest.raises(ValueError):
            encode_block(raw, layout=layout, fingerprint=fp, key=KEY, **kwargs)
    for bad in (raw[:-1], raw.reshape(2, -1)[:, ::2], "text"):
        with pytest.raises(BadRequest):
            encode_block(bad, layout=layout, fingerprint=fp, key=KEY)
    with pytest.raises(BadRequest):
        encode_block(raw, layout=layout, fingerprint=fp[:8], key=KEY)
    with pytest.raises(BadRequest):
        encode_block(raw, layout=layout, fingerprint=fp, key=b"")
    assert not issubclass(CodecError, ValueError) and issubclass(CodecError, TierKVError)


def test_thread_safety_concurrent_encode_decode(kv_sample):
    """Many threads share the module (zstd contexts are per thread): results equal the serial ones."""
    layout = _layout("bfloat16")
    fp = _fp(layout)
    blocks = _blocks(kv_sample, "bfloat16", starts=range(0, 1024, 128))
    codecs = ["lossless", "zstd", "int8", "int4", "fp8"]
    expected = {(i, c): encode_block(b, layout=layout, fingerprint=fp, key=KEY, codec=c)
                for i, b in enumerate(blocks) for c in codecs}
    decoded = {k: decode_block(v, layout=layout, fingerprint=fp, key=KEY).tobytes() for k, v in expected.items()}
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            order = list(expected)
            np.random.default_rng(seed).shuffle(order)
            for i, c in order * 2:
                blob = encode_block(blocks[i], layout=layout, fingerprint=fp, key=KEY, codec=c)
                assert blob == expected[(i, c)]
                assert decode_block(blob, layout=layout, fingerprint=fp, key=KEY).tobytes() == decoded[(i, c)]
        except BaseException as exc:  # noqa: BLE001 - surfaced by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors

"""Hostile encoded blocks: every corruption, lie or foreign blob is a CodecError, never wrong data or a crash."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import as_earlier_format
from tierkv.codecs import (
    CodecError,
    EarlierFormat,
    ForeignBlock,
    available_codecs,
    decode_block,
    encode_block,
    read_header,
)
from tierkv.codecs.container import frame_hash, pack_header, pack_params
from tierkv.core.keys import Namespace
from tierkv.core.layout import Layout

LAYOUT = Layout(4, 2, 32, 16, "bfloat16")
FP = Namespace("model-a", LAYOUT).fingerprint
KEY = b"block-key-0001"


def _block(layout: Layout = LAYOUT, seed: int = 0) -> np.ndarray:
    """KV-like bf16 bytes: normal values with per-channel scales (compressible exponent plane)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(layout.block_shape).astype(np.float32) * rng.uniform(0.1, 4, layout.head_dim)
    return torch.from_numpy(x).to(layout.torch_dtype).view(torch.uint8).numpy().reshape(-1).copy()


def _decode(blob, layout=LAYOUT, fp=FP, key=KEY):
    return decode_block(blob, layout=layout, fingerprint=fp, key=key)


@pytest.fixture(scope="module", params=["lossless", "zstd", "raw", "int8", "int4", "fp8"])
def blob(request) -> bytes:
    return encode_block(_block(), layout=LAYOUT, fingerprint=FP, key=KEY, codec=request.param)


def test_valid_blob_decodes(blob):
    _decode(blob)


def test_foreign_namespace_wrong_key_wrong_layout(blob):
    other = Namespace("model-b", LAYOUT).fingerprint
    with pytest.raises(ForeignBlock, match="namespace"):
        _decode(blob, fp=other)
    same_name_other_weights = Namespace("model-a", LAYOUT, identity="f" * 32).fingerprint
    with pytest.raises(ForeignBlock, match="namespace"):
        _decode(blob, fp=same_name_other_weights)
    with pytest.raises(CodecError, match="checksum"):
        _decode(blob, key=b"block-key-0002")
    with pytest.raises(CodecError, match="layout"):
        _decode(blob, layout=Layout(4, 2, 32, 16, "float16"))
    with pytest.raises(CodecError, match="layout"):
        _decode(blob, layout=Layout(2, 4, 32, 16, "bfloat16"))


def test_a_block_of_the_earlier_format_is_a_miss_of_its_own_kind(blob):
    old = as_earlier_format(blob, 1)  # what an earlier tierkv wrote (its header hash made to match)
    with pytest.raises(EarlierFormat, match="earlier format"):
        read_header(old)
    with pytest.raises(EarlierFormat):
        _decode(old)


def test_a_block_of_format_2_is_read_without_a_frame_hash():
    """Format 2 keyed blocks as this tierkv does and framed them without the frame hash: still served."""
    layout = Layout(2, 2, 32, 16, "bfloat16")
    raw = np.zeros(layout.block_bytes, dtype=np.uint8)
    raw[1::2] = np.random.default_rng(4).integers(60, 64, layout.block_elems, dtype=np.uint8)
    blob = encode_block(raw, layout=layout, fingerprint=FP, key=KEY, codec="lossless")
    old = as_earlier_format(blob, 2)
    h = read_header(old)
    assert (h.version, h.frame_hash, len(old)) == (2, None, len(blob) - 8)
    assert any(s.method == "zstd" for s in h.sections)
    assert decode_block(old, layout=layout, fingerprint=FP, key=KEY).tobytes() == raw.tobytes()
    bad = bytearray(old)
    bad[h.header_len + 100] ^= 0x01  # still checked by the checksum over the decoded block
    with pytest.raises(CodecError):
        decode_block(bytes(bad), layout=layout, fingerprint=FP, key=KEY)


def test_every_truncation_and_extension_is_rejected(blob):
    for n in sorted({0, 1, 3, 4, 20, 70, *range(60, min(len(blob), 200)), len(blob) // 2, len(blob) - 1}):
        with pytest.raises(CodecError):
            _decode(blob[:n])
        with pytest.raises(CodecError):
            read_header(blob[:n])
    with pytest.raises(CodecError):
        _decode(blob + b"\x00")


def test_every_header_byte_flip_is_rejected(blob):
    header_len = read_header(blob).header_len
    for i in range(header_len):
        bad = bytearray(blob)
        bad[i] ^= 0x41
        with pytest.raises(CodecError):
            _decode(bytes(bad))


def test_payload_byte_flips_are_rejected(blob):
    h = read_header(blob)
    rng = np.random.default_rng(3)
    for i in rng.integers(h.header_len, len(blob), 40):
        bad = bytearray(blob)
        bad[i] ^= 1 << int(rng.integers(0, 8))
        with pytest.raises(CodecError):
            _decode(bytes(bad))


def test_garbage_and_non_buffers():
    rng = np.random.default_rng(5)
    for n in (0, 1, 8, 100, 5000, LAYOUT.block_bytes):
        with pytest.raises(CodecError):
            _decode(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
    for junk in (None, 42, "TKVB", [1, 2, 3]):
        with pytest.raises(CodecError):
            read_header(junk)


def _forge(sections: list[tuple[int, bytes, int]], *, layout: Layout = LAYOUT, codec_id: int = 2,
           params: dict | None = None, scope: int = 1, raw_len: int | None = None,
           fixed_patch: dict[int, bytes] | None = None) -> bytes:
    """A blob with a *valid* header hash around arbitrary sections: (method, stored bytes, declared decoded_len)."""
    header = bytearray(pack_header(codec_id=codec_id, layout=layout, fingerprint=FP, checksum=b"\0" * 16, scope=scope,
                                   params=pack_params(params or {}),
                                   sections=[(m, len(s), d) for m, s, d in sections],
                                   frames=frame_hash([s for m, s, _ in sections if m == 1])))
    if raw_len is not None or fixed_patch:
        if raw_len is not None:
            struct.pack_into("<Q", header, 24, raw_len)
        for off, data in (fixed_patch or {}).items():
            header[off:off + len(data)] = data
        struct.pack_into("<Q", header, len(header) - 8, xxhash.xxh3_64_intdigest(bytes(header[:-8])))
    return bytes(header) + b"".join(s for _, s, _ in sections)


HALF = LAYOUT.block_elems  # bytes of one bf16 byte plane


def test_forged_blob_is_otherwise_well_formed():
    plane = bytes(HALF)
    blob = _forge([(0, plane, HALF), (0, plane, HALF)])
    assert read_header(blob).codec == "lossless"
    with pytest.raises(CodecError, match="checksum"):  # forged checksum
        _decode(blob)


def test_declared_sizes_must_match_layout():
    plane = bytes(HALF)
    cases = [
        [(0, plane, HALF)],  # a section missing
        [(0, plane, HALF), (0, plane, HALF), (0, b"", 0)],  # an extra section
        [(0, plane, HALF + 1), (0, plane, HALF)],  # decoded size not the layout's
        [(0, plane, 0xFFFFFFFF), (0, plane, HALF)],  # a huge decoded size
        [(0, plane[:-1], HALF), (0, plane, HALF)],  # a raw section shorter than declared
        [(1, b"", HALF), (0, plane, HALF)],  # an empty zstd section
    ]
    for sections in cases:
        with pytest.raises(CodecError):
            read_header(_forge(sections))  # the startup scan and `tierkv verify` see it too
        with pytest.raises(CodecError):
            _decode(_forge(sections))


def test_header_claiming_huge_sizes():
    plane = bytes(HALF)
    with pytest.raises(CodecError):
        read_header(_forge([(0, plane, HALF), (0, plane, HALF)], raw_len=1 << 60))
    # a layout of 2**32 layers: rejected by Layout validation before anything is sized from it
    huge = _forge([(0, plane, HALF), (0, plane, HALF)], fixed_patch={8: struct.pack("<I", 0xFFFFFFFF)})
    with pytest.raises(CodecError):
        read_header(huge)
    # a params length over the cap
    with pytest.raises(CodecError):
        read_header(_forge([(0, plane, HALF), (0, plane, HALF)], fixed_patch={64: struct.pack("<H", 0xFFFF)}))


def test_decompression_bombs_and_lying_frames():
    cctx = zstandard.ZstdCompressor(level=1)
    plane = bytes(HALF)
    # 64 MiB of zeros in a ~2 KB frame, in a section that must decode to HALF bytes
    bomb = cctx.compress(bytes(64 << 20))
    assert len(bomb) < 8192
    cases = {
        "bomb": bomb,
        "no content size": zstandard.ZstdCompressor(level=1, write_content_size=False).compress(plane),
        "two frames": cctx.compress(plane[: HALF // 2]) + cctx.compress(plane[HALF // 2:]),
        "trailing bytes": cctx.compress(plane) + b"\x00\x01",
        "truncated frame": cctx.compress(np.random.default_rng(1).integers(0, 40, HALF, dtype=np.uint8))[:-20],
        "not zstd": b"\x00" * 64,
    }
    # a frame that declares HALF bytes but holds 2 * HALF: patch its content-size field
    big = cctx.compress(bytes(2 * HALF))
    fhd = big[4]
    off = 5 + (0 if fhd & 0x20 else 1)  # the content size follows the descriptor (and window byte)
    field = {1: struct.pack("<H", HALF - 256), 2: struct.pack("<I", HALF)}[fhd >> 6]
    cases["lying content size"] = big[:off] + field + big[off + len(field):]
    assert zstandard.get_frame_parameters(cases["lying content size"]).content_size == HALF
    for name, frame in cases.items():
        with pytest.raises(CodecError) as caught:
            _decode(_forge([(1, frame, HALF), (0, plane, HALF)]))
        assert "frame hash" not in str(caught.value), name  # the forger hashed its frames: the guards caught it


def test_a_flip_the_zstd_decoder_ignores_is_still_detected():
    """A zstd frame header has an unused bit (bit 4 of its descriptor, byte 4) the decoder does not read:
    flipped, the frame decodes to the same bytes, so only the frame hash can see it."""
    layout = Layout(2, 2, 32, 16, "bfloat16")
    raw = np.zeros(layout.block_bytes, dtype=np.uint8)
    raw[1::2] = np.random.default_rng(3).integers(60, 64, layout.block_elems, dtype=np.uint8)
    for codec in ("zstd", "lossless"):
        blob = encode_block(raw, layout=layout, fingerprint=FP, key=KEY, codec=codec)
        h = read_header(blob)
        off = h.header_len
        for s in h.sections:
            if s.method == "zstd":
                bad = bytearray(blob)
                bad[off + 4] ^= 0x10
                assert zstandard.ZstdDecompressor().decompress(bytes(bad[off:off + s.stored_len])) == \
                    zstandard.ZstdDecompressor().decompress(bytes(blob[off:off + s.stored_len]))
                with pytest.raises(CodecError, match="frame hash"):
                    decode_block(bytes(bad), layout=layout, fingerprint=FP, key=KEY)
            off += s.stored_len
        assert any(s.method == "zstd" for s in h.sections), codec


def test_bad_params_and_ids():
    plane = bytes(HALF)
    good = [(0, plane, HALF), (0, plane, HALF)]
    with pytest.raises(CodecError):  # unknown codec id
        read_header(_forge(good, codec_id=200))
    with pytest.raises(CodecError):  # scope not matching the codec
        read_header(_forge(good, scope=2))
    with pytest.raises(CodecError):  # unknown parameter
        _decode(_forge(good, params={"zap": 1}))
    with pytest.raises(CodecError):  # non-canonical parameter value
        _decode(_forge(good, params={"channel_major": False}))
    with pytest.raises(CodecError):  # int4 with a group that does not divide head_dim
        _decode(_forge(good, codec_id=5, scope=2, params={"int8_layers": 2, "group": 7}))
    # params bytes that are not msgpack: forge a header whose params section is garbage
    header = bytearray(pack_header(codec_id=2, layout=LAYOUT, fingerprint=FP, checksum=b"\0" * 16, scope=1,
                                   params=b"\xc1\xc1\xc1", sections=[(0, HALF, HALF), (0, HALF, HALF)]))
    struct.pack_into("<Q", header, len(header) - 8, xxhash.xxh3_64_intdigest(bytes(header[:-8])))
    with pytest.raises(CodecError):
        read_header(bytes(header) + plane + plane)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.integers(1, 3), heads=st.integers(1, 3), dim=st.sampled_from([2, 8, 32]),
       tokens=st.integers(1, 16), dtype=st.sampled_from(["bfloat16", "float16", "float32", "int8"]),
       codec=st.sampled_from(["lossless", "zstd", "raw"]), seed=st.integers(0, 2**32 - 1),
       flip=st.integers(0, 10**9))
def test_roundtrip_property(layers, heads, dim, tokens, dtype, codec, seed, flip):
    """Lossless codecs round-trip any bytes in any layout; one flipped bit anywhere is always detected."""
    layout = Layout(layers, heads, dim, tokens, dtype)
    fp = Namespace("m", layout).fingerprint
    rng = np.random.default_rng(seed)
    # mix of compressible (narrow exponents) and random bytes
    raw = rng.integers(0, 256, layout.block_bytes, dtype=np.uint8)
    raw[1::layout.itemsize] = rng.integers(60, 64, raw[1::layout.itemsize].size, dtype=np.uint8) if seed % 2 else 0
    blob = encode_block(raw, layout=layout, fingerprint=fp, key=KEY, codec=codec)
    assert decode_block(blob, layout=layout, fingerprint=fp, key=KEY).tobytes() == raw.tobytes()
    bad = bytearray(blob)
    bad[flip % len(bad)] ^= 1 << (flip % 8)
    with pytest.raises(CodecError):
        decode_block(bytes(bad), layout=layout, fingerprint=fp, key=KEY)


def test_all_codecs_reject_the_same_hostile_input():
    for codec in available_codecs():
        blob = encode_block(_block(seed=9), layout=LAYOUT, fingerprint=FP, key=KEY, codec=codec)
        with pytest.raises(CodecError):
            _decode(blob[:-1])


@pytest.mark.parametrize("codec", ["fp8", "int8", "int4"])
def test_lossy_decoders_survive_arbitrary_sections(codec):
    """Sections that pass the checksum but hold anything (a forger who recomputed xxh3) never crash a decoder."""
    from tierkv.codecs.encoding import _digest
    from tierkv.codecs.registry import get_codec

    c = get_codec(codec)
    params = c.make_params(LAYOUT, {})
    sizes = c.section_sizes(LAYOUT, params)
    rng = np.random.default_rng(11)
    for trial in range(4):
        if trial == 0:  # all 0xFF: NaN scales and ranges, saturated codes
            secs = [b"\xff" * n for n in sizes]
        else:
            secs = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
        header = pack_header(codec_id=c.codec_id, layout=LAYOUT, fingerprint=FP, checksum=_digest(secs, FP, KEY),
                             scope=2, params=pack_params(params), sections=[(0, n, n) for n in sizes])
        out = _decode(header + b"".join(secs))
        assert out.nbytes == LAYOUT.block_bytes


def test_fp8_encoder_matches_torch():
    from tierkv.codecs.quant import to_e4m3

    rng = np.random.default_rng(2)
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    vals = np.unique(grid[np.isfinite(grid)]).astype(np.float64)
    mids = ((vals[1:] + vals[:-1]) / 2).astype(np.float32)  # ties: round to even
    x = np.concatenate([vals.astype(np.float32), mids, np.nextafter(mids, np.float32(np.inf)),
                        np.nextafter(mids, np.float32(-np.inf)), rng.uniform(-448, 448, 100_000).astype(np.float32),
                        (rng.standard_normal(100_000) * 0.01).astype(np.float32), np.float32([0.0, -0.0])])
    x = np.clip(x, -448, 448).astype(np.float32)
    expected = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(to_e4m3(x), expected)

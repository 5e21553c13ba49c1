"""A model's identity: equal weights and settings give equal identities wherever the files are; any
change of a tensor, a KV-relevant config field, the dtype or the adapter gives another; digests are
kept by path, size and mtime, so a restart reads no weights."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tierkv.client.identity import adapter_identity, config_digest, model_identity, tensors_digest
from tierkv.client.weights import DigestCache, file_digest, weights_digest
from tierkv.core.keys import Namespace, chain_keys
from tierkv.core.layout import Layout

LAYOUT = Layout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4, dtype="float32")


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.{w}": torch.randn(64, 256, generator=g) for i in range(3) for w in ("k", "v", "q")} | {
        "norm": torch.ones(8)}


def _model(root: Path, name: str = "model", tensors: dict[str, torch.Tensor] | None = None,
           config: dict | None = None) -> Path:
    d = root / name
    d.mkdir(parents=True)
    save_file(tensors if tensors is not None else _tensors(), str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(config or {"model_type": "llama", "rope_theta": 10000.0}))
    (d / "tokenizer.json").write_text("{}")
    return d


@pytest.fixture
def cache(tmp_path: Path) -> DigestCache:
    return DigestCache(tmp_path / "cache" / "digests.json")


def test_the_same_weights_in_another_directory_have_the_same_digest(tmp_path, cache):
    a = _model(tmp_path / "a")
    b = tmp_path / "b" / "another-name"
    shutil.copytree(a, b)
    (b / "README.md").write_text("not weights")
    assert weights_digest(a, cache=cache) == weights_digest(b, cache=cache)
    assert weights_digest(a, "full", cache) == weights_digest(b, "full", cache)


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_changing_one_tensors_values_changes_the_digest(tmp_path, cache, where):
    edited = _tensors()
    t = edited["layers.1.v"].view(-1)
    i = {"start": 0, "middle": t.numel() // 2, "end": t.numel() - 1}[where]
    t[i] += 1.0
    assert weights_digest(_model(tmp_path / "a"), cache=cache) != weights_digest(
        _model(tmp_path / "b", tensors=edited), cache=cache)


def test_other_weights_renamed_tensors_and_extra_files_change_the_digest(tmp_path, cache):
    base = weights_digest(_model(tmp_path / "a"), cache=cache)
    assert weights_digest(_model(tmp_path / "b", tensors=_tensors(seed=1)), cache=cache) != base
    renamed = {k.replace("norm", "final_norm"): v for k, v in _tensors().items()}
    assert weights_digest(_model(tmp_path / "c", tensors=renamed), cache=cache) != base
    d = _model(tmp_path / "d")
    save_file({"extra": torch.zeros(4)}, str(d / "model-extra.safetensors"))
    assert weights_digest(d, cache=cache) != base


def test_a_digest_is_kept_by_path_size_and_mtime(tmp_path, cache):
    d = _model(tmp_path / "a")
    f = d / "model.safetensors"
    first = file_digest(f, cache=cache)
    assert cache.path is not None and cache.path.exists()
    st = os.stat(f)
    # Same size and mtime, other bytes: the kept digest is returned without reading the file.
    with open(f, "r+b") as fh:
        fh.seek(st.st_size - 4)
        fh.write(b"\xff\xff\xff\xff")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_digest(f, cache=cache) == first
    # A new mtime: read again, and the edit (in the last tensor's last window) is seen.
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert file_digest(f, cache=cache) != first


def test_an_unwritable_cache_only_costs_recomputing(tmp_path):
    d = _model(tmp_path / "a")
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("x")
    assert weights_digest(d, cache=DigestCache(blocked / "digests.json")) == \
        weights_digest(d, cache=DigestCache(None))


def test_a_file_that_is_not_safetensors_is_digested_whole_or_spread(tmp_path, cache):
    f = tmp_path / "model.gguf"
    f.write_bytes(os.urandom(1 << 16))
    first = weights_digest(f, cache=cache)
    data = bytearray(f.read_bytes())
    data[1000] ^= 1
    f.write_bytes(bytes(data))
    assert weights_digest(f, cache=cache) != first


def test_no_weights_is_an_error(tmp_path, cache):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError):
        weights_digest(tmp_path / "empty", cache=cache)
    with pytest.raises(FileNotFoundError):
        weights_digest(tmp_path / "missing", cache=cache)


def test_config_fields_that_change_kv_change_the_identity_and_others_do_not():
    cfg = {"model_type": "llama", "rope_theta": 10000.0, "rope_scaling": None, "sliding_window": None,
           "eos_token_id": 2, "_name_or_path": "/a/model", "transformers_version": "5.19.0",
           "text_config": {"rope_theta": 1.0, "_name_or_path": "x"}}
    base = config_digest(cfg)
    assert config_digest({**cfg, "eos_token_id": 7, "_name_or_path": "/b/other", "transformers_version": "6"}) == base
    assert config_digest({**cfg, "text_config": {"rope_theta": 1.0, "_name_or_path": "y"}}) == base
    assert config_digest(dict(reversed(list(cfg.items())))) == base
    for change in ({"rope_theta": 500000.0}, {"rope_scaling": {"type": "yarn", "factor": 4.0}},
                   {"sliding_window": 4096}, {"quantization_config": {"quant_method": "fp8"}},
                   {"text_config": {"rope_theta": 2.0}}):
        assert config_digest({**cfg, **change}) != base, change


def test_dtype_kv_cache_dtype_revision_and_quantization_change_the_identity():
    args = dict(weights="w", config={"model_type": "llama"}, dtype="bfloat16")
    base = model_identity(**args)
    assert model_identity(**args) == base and len(base) == 32
    for change in ({"dtype": "float16"}, {"kv_cache_dtype": "fp8"}, {"revision": "abc"}, {"quantization": "awq"},
                   {"weights": "w2"}, {"extra": {"load_format": "gguf"}}):
        assert model_identity(**{**args, **change}) != base, change


def test_an_adapter_is_identified_by_its_weights_and_config_not_by_where_the_base_was(tmp_path, cache):
    def adapter(root: Path, seed: int, base: str, r: int = 8) -> Path:
        root.mkdir(parents=True)
        g = torch.Generator().manual_seed(seed)
        save_file({"base_model.model.layers.0.self_attn.k_proj.lora_A.weight": torch.randn(r, 16, generator=g)},
                  str(root / "adapter_model.safetensors"))
        (root / "adapter_config.json").write_text(json.dumps({"r": r, "lora_alpha": 16, "peft_type": "LORA",
                                                              "target_modules": ["k_proj", "v_proj"],
                                                              "base_model_name_or_path": base}))
        return root

    a = adapter_identity(adapter(tmp_path / "a", 0, "/models/x"), cache=cache)
    assert adapter_identity(adapter(tmp_path / "b", 0, "/elsewhere/x"), cache=cache) == a
    assert adapter_identity(adapter(tmp_path / "c", 1, "/models/x"), cache=cache) != a
    cfg = tmp_path / "a" / "adapter_config.json"
    cfg.write_text(cfg.read_text().replace('"lora_alpha": 16', '"lora_alpha": 32'))
    assert adapter_identity(tmp_path / "a", cache=cache) != a
    with pytest.raises(FileNotFoundError):
        adapter_identity(tmp_path / "none", cache=cache)


def test_loaded_tensors_digest_as_their_values_and_shapes():
    t = _tensors()
    base = tensors_digest(t)
    assert tensors_digest({k: v.clone() for k, v in t.items()}) == base
    t2 = {k: v.clone() for k, v in t.items()}
    t2["layers.0.k"][32, 128] += 1
    assert tensors_digest(t2) != base
    assert tensors_digest({**t, "norm": torch.ones(8, dtype=torch.float16)}) != base


def test_the_identity_not_the_label_decides_the_namespace():
    a = Namespace("model", LAYOUT, identity="1" * 32)
    assert Namespace("another-label", LAYOUT, identity="1" * 32).fingerprint == a.fingerprint
    assert Namespace("model", LAYOUT, identity="2" * 32).fingerprint != a.fingerprint
    assert Namespace("model", LAYOUT).fingerprint != a.fingerprint  # by name: another namespace
    assert Namespace("model", LAYOUT).fingerprint != Namespace("other", LAYOUT).fingerprint
    assert Namespace.from_dict(a.to_dict()) == a


def test_a_namespace_of_an_earlier_format_or_a_bad_identity_is_refused():
    d = Namespace("model", LAYOUT).to_dict()
    with pytest.raises(ValueError, match="namespace format 1"):
        Namespace.from_dict({**d, "format_version": 1})
    with pytest.raises(ValueError, match="namespace format 1"):
        Namespace.from_dict({k: v for k, v in d.items() if k != "format_version"})
    for bad in ("x" * 300, "a\nb"):
        with pytest.raises(ValueError, match="identity"):
            Namespace("model", LAYOUT, identity=bad)


def test_extras_key_blocks_apart_and_chain_on():
    fp = Namespace("model", LAYOUT, identity="1" * 32).fingerprint
    tokens = list(range(12))
    plain = chain_keys(fp, tokens, 4)
    assert chain_keys(fp, tokens, 4, extras=[None, None, None]) == plain
    image = chain_keys(fp, tokens, 4, extras=[None, b"img-a", None])
    assert image[0] == plain[0] and image[1] != plain[1] and image[2] != plain[2]
    assert chain_keys(fp, tokens, 4, extras=[None, b"img-b", None])[1] != image[1]

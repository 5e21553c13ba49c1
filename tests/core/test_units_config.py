from __future__ import annotations

import pytest

from tierkv.core.units import format_size, parse_size
from tierkv.daemon.config import load_config


def test_parse_size():
    assert parse_size("8GiB") == 8 << 30
    assert parse_size("512 MiB") == 512 << 20
    assert parse_size("100GB") == 100 * 10**9
    assert parse_size(4096) == 4096
    assert parse_size("1.5KiB") == 1536
    for bad in ("", "12XB", "-5", "GiB", True):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert format_size(3 << 30) == "3.0 GiB"


def test_precedence(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[host]\ncapacity = "2GiB"\nslab_bytes = "16MiB"\n[disk]\ncodec = "zstd"\n')
    cfg = load_config(f, env={"TIERKV_HOST_CAPACITY": "3GiB", "TIERKV_DISK_WORKERS": "3"},
                      overrides={"disk.codec": "raw"})
    assert cfg.host.capacity == 3 << 30 and cfg.sources["host.capacity"] == "env:TIERKV_HOST_CAPACITY"
    assert cfg.host.slab_bytes == 16 << 20 and cfg.sources["host.slab_bytes"].startswith("file:")
    assert cfg.disk.codec == "raw" and cfg.sources["disk.codec"] == "flag"
    assert cfg.disk.workers == 3


@pytest.mark.parametrize("text,match", [
    ('[host]\ncapacity = "lots"\n', "host.capacity"),
    ('[hots]\ncapacity = 1\n', "unknown section"),
    ('[host]\ncolour = 1\n', "unknown setting"),
    ('[host]\nhigh_watermark = 0.5\nlow_watermark = 0.9\n', "watermarks"),
    ('[disk]\nsync = "maybe"\n', "disk.sync"),
    ("[host\n", "bad TOML"),
])
def test_bad_config(tmp_path, text, match):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_config(f, env={})


def test_default_config_file_is_the_built_in_defaults():
    """configs/default.toml (the package's copy) sets every setting the dataclasses default to, to that
    default: a default changed in one place and not the other fails here."""
    import dataclasses
    import tomllib
    from pathlib import Path

    from tierkv.daemon.config import Config

    path = Path(__file__).parents[2] / "configs" / "default.toml"
    cfg, built_in = load_config(path, env={}), Config()
    assert cfg == built_in
    toml = tomllib.loads(path.read_text())
    for section in ("server", "host", "disk", "gpu", "budget", "events", "store"):
        fields = {f.name for f in dataclasses.fields(getattr(built_in, section))}
        written = set(toml.get(section, {}))
        assert written <= fields, (section, written - fields)


def _disk_docs() -> dict[str, tuple[str, str]]:
    """Where the disk tier's eviction is documented: place -> (text, the policy in effect there)."""
    import ast
    from pathlib import Path

    from tierkv.daemon.config import DiskConfig

    root = Path(__file__).parents[2]
    default = DiskConfig().policy
    tree = ast.parse((root / "tierkv" / "daemon" / "sections.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DiskConfig")
    field_docs = [n.value.value for n in cls.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)]
    docs = {"sections.py DiskConfig": ("\n".join(field_docs), default)}
    for path in sorted((root / "configs").glob("*.toml")):
        section = path.read_text().split("[disk]", 1)[1].split("\n[", 1)[0]
        policy = load_config(path, env={}).disk.policy
        docs[path.name] = ("\n".join(ln for ln in section.splitlines() if ln.lstrip().startswith("#")), policy)
    readme = [ln for ln in (root / "README.md").read_text().splitlines() if ln.startswith("| `disk.")]
    docs["README.md"] = ("\n".join(readme), default)
    return docs


def test_disk_eviction_docs_match_the_policy():
    for place, (text, policy) in _disk_docs().items():
        lowered = text.lower().replace("-", " ")
        if policy != "lru":
            assert "least recently used" not in lowered, f"{place} says LRU, the policy is {policy}"


@pytest.mark.parametrize("capacity", ["8MiB", "16MiB", "4KiB"])
def test_small_host_capacity_with_the_default_slab(capacity):
    cfg = load_config(env={}, overrides={"host.capacity": capacity})
    assert cfg.host.capacity == parse_size(capacity) and cfg.host.slab_bytes == 32 << 20


@pytest.mark.parametrize("key,value,match", [
    ("host.capacity", "100", "host.capacity"),
    ("host.slab_bytes", "5000", "host.slab_bytes"),
])
def test_bad_host_sizes(key, value, match):
    with pytest.raises(ValueError, match=match):
        load_config(env={}, overrides={key: value})

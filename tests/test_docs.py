"""The README is the user's manual: short, true to the config, and about the software, not its history."""

from __future__ import annotations

import dataclasses
import re

from tierkv.cache.policy import policy_class, policy_names
from tierkv.daemon.config import Config

from .helpers import REPO

DOCS = [REPO / "README.md", REPO / "docs" / "design.md", REPO / "docs" / "benchmarks.md"]


def test_readme_is_a_manual_of_bounded_length():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 350
    assert "## vLLM" in "\n".join(lines) or "### vLLM" in "\n".join(lines)


def test_every_setting_is_in_the_configuration_reference():
    text = (REPO / "README.md").read_text()
    cfg = Config()
    keys = [f"{sec}.{f.name}" for sec in Config.SECTIONS if sec != "policy"
            for f in dataclasses.fields(getattr(cfg, sec))]
    keys += sorted({f"policy.{k}" for n in policy_names() for k in policy_class(n).SETTINGS})
    missing = [k for k in keys if f"`{k}`" not in text]
    assert not missing, missing


def test_docs_describe_the_software_not_its_development():
    narration = re.compile(r"\b(this|last|previous|earlier|first|second|third|fourth) session\b|\bsession \d"
                           r"|\bissue \d|\bissue #|\bpreviously\b|\bearlier (run|version|code)\b"
                           r"|\bbefore the fix\b|\bno longer\b|\bused to\b", re.IGNORECASE)
    for path in DOCS:
        hits = [line for line in path.read_text().splitlines() if narration.search(line)]
        assert not hits, (path.name, hits[:3])

"""The README is the user's manual: short, true to the config, and about the software, not its history."""

from __future__ import annotations

import dataclasses
import re

from tests.helpers import REPO
from tierkv.cache.policy import policy_class, policy_names
from tierkv.daemon.config import Config

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


# A grade of a figure against a goal: "target" as a goal (not threading's ``target=`` nor pip's
# ``--target``), goals, verdicts, PASS/FAIL/MISS as printed words, "ok"/"pass"/"missed" as values, and
# met/missed as labels or table columns. "a miss", "the returns missed between" and the like are figures.
GRADE = re.compile(r"""
    (?<!-)target(?!=)
  | \bgoals?\b
  | \bverdicts?\b
  | (?-i:\b(?:PASS|FAIL|MISS)\b)
  | ["'](?:ok|pass|fail|miss|met|missed)["']
  | \b(?:met|missed)\s*:
  | \*\*(?:met|missed)\*\*
  | \|\s*(?:met|missed)\s*\|
  | \bnot\s+met\b
""", re.IGNORECASE | re.VERBOSE)


def test_docs_and_benchmarks_state_figures_not_grades():
    """The docs and the tools print figures and ratios against references of the same run, never a
    verdict against a target."""
    paths = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "tools").glob("*.py")),
             *sorted((REPO / "tools").glob("*.sh"))]
    hits = [f"{p.relative_to(REPO)}:{n}: {line.strip()}" for p in paths
            for n, line in enumerate(p.read_text().splitlines(), 1) if GRADE.search(line)]
    assert not hits, hits[:5]


def test_the_grade_pattern_tells_grades_from_figures():
    grades = ["TARGET = 0.9", '"target": TARGET', "| measure | ratio | target |", "Targets: p50 <= 200 us",
              'fig["host_target_met"] = r <= 0.1', "ok = 'ok' if r >= 0.9 else 'MISS'", '"pass": bool(ok)',
              "missed: 0.72x", "**missed**", "| rule | met |", "the goal was 1.0x", "verdict: PASS"]
    figures = ["threading.Thread(target=run, daemon=True)", "pip install --target /tmp/site x.whl",
               "the returns missed between the rule starting", "the missed blocks are recomputed",
               "a miss costs one prefill", "best of 5 passes", "failed requests", "FAILED: no server",
               "tierkv health prints `ok` or `degraded`"]
    assert all(GRADE.search(s) for s in grades), [s for s in grades if not GRADE.search(s)]
    assert not any(GRADE.search(s) for s in figures), [s for s in figures if GRADE.search(s)]

"""The package's import contracts (pyproject.toml's [tool.importlinter]) and what an engine process loads."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO


def _lint_imports() -> list[str]:
    exe = Path(sys.executable).with_name("lint-imports")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("lint-imports")
    if found is None:
        pytest.skip("import-linter is not installed (the test extra)")
    return [found]


def test_import_contracts_hold():
    out = subprocess.run([*_lint_imports(), "--no-cache", "--no-logo"], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr


def test_client_import_loads_no_daemon_code():
    """An engine process imports tierkv.client: Redis, LMDB and the daemon stay out of it."""
    code = ("import json, sys, tierkv.client; print(json.dumps(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('redis', 'lmdb') or m.startswith(('tierkv.daemon', 'tierkv.movers', "
            "'tierkv.tiers')))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []

"""The package's import contracts (pyproject.toml's [tool.importlinter]) and what an engine process loads."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, type_check


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


@pytest.mark.timeout(600)
def test_the_package_type_checks():
    """mypy under pyproject.toml's [tool.mypy] (every function annotated) finds no error in tierkv/. Its
    cache is the checkout's .mypy_cache: a later run checks only what changed (a first one takes ~1 min)."""
    pytest.importorskip("mypy", reason="mypy is not installed (the test extra)")
    assert _pyproject()["tool"]["mypy"]["disallow_untyped_defs"] is True
    rc, out = type_check()  # started with the session (tests/conftest.py), beside the tests before this one
    assert rc == 0, out


def test_client_import_loads_no_daemon_code():
    """An engine process imports tierkv.client: Redis, LMDB and the daemon stay out of it."""
    code = ("import json, sys, tierkv.client; print(json.dumps(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('redis', 'lmdb') or m.startswith(('tierkv.daemon', 'tierkv.movers', "
            "'tierkv.tiers')))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _imported_top_modules(root: Path) -> set[str]:
    """Top-level names of every module imported anywhere under ``root`` (lazy imports included)."""
    import ast

    names = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return names


def _top_modules(dist: str) -> set[str]:
    """The import names a distribution provides (``prometheus-client`` -> ``prometheus_client``)."""
    from importlib.metadata import packages_distributions

    wanted = dist.lower().replace("-", "_")
    found = {mod for mod, dists in packages_distributions().items()
             if any(d.lower().replace("-", "_") == wanted for d in dists)}
    return found or {wanted}


def test_every_runtime_dependency_is_used():
    import re

    imported = _imported_top_modules(REPO / "tierkv")
    unused = []
    for req in _pyproject()["project"]["dependencies"]:
        dist = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
        if not _top_modules(dist) & imported:
            unused.append(dist)
    assert unused == [], f"declared in [project.dependencies] but imported nowhere in tierkv/: {unused}"


def test_every_package_data_pattern_matches_a_file():
    data = _pyproject()["tool"]["setuptools"].get("package-data", {})
    missing = [f"{pkg}: {pattern}" for pkg, patterns in data.items() for pattern in patterns
               if not any(p.is_file() for p in (REPO / pkg.replace(".", "/")).glob(pattern))]
    assert missing == [], f"package-data patterns that match no file: {missing}"


def test_paths_into_the_repository_resolve():
    # Modules that read files of the checkout name them relative to their own place in it.
    import mainjob  # examples/ (make run)

    from tierkv.ops import replay_cli

    assert mainjob.CONFIG.is_file(), mainjob.CONFIG
    assert replay_cli.DEFAULT_CONFIG.is_file(), replay_cli.DEFAULT_CONFIG


def test_the_cli_and_the_daemon_start_without_torch():
    # torch costs over a second to import: a CLI call or a daemon start must not wait for it.
    code = ("import sys, tierkv.ops.cli, tierkv.client.admin, tierkv.daemon.server; "
            "sys.exit('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr or "torch was imported"


def test_the_package_carries_what_it_reads_at_run_time():
    """The CUDA kernel's source and the default settings are package data (a wheel carries them): the
    package reads nothing at run time from outside itself."""
    import tomllib

    from tierkv.client.paged.kernel import kernel_source
    from tierkv.ops import replay_cli

    pkg = REPO / "tierkv"
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["tierkv"]
    shipped = {p for pat in patterns for p in pkg.glob(pat)}
    assert {pkg / "_native" / "paged_kv.cu", replay_cli.DEFAULT_CONFIG} <= shipped
    assert "TKV_UNROLL" in kernel_source()


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for d in edges[m]:
            if d not in index:
                visit(d)
                low[m] = min(low[m], low[d])
            elif d in on_stack:
                low[m] = min(low[m], index[d])
        if low[m] == index[m]:
            comp = []
            while True:
                x = stack.pop()
                on_stack.discard(x)
                comp.append(x)
                if x == m:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in sorted(edges):
        if m not in index:
            visit(m)
    return out


def test_the_daemon_modules_import_in_one_direction():
    """No circle of imports among tierkv.daemon's modules, counting imports made for annotations only."""
    grimp = pytest.importorskip("grimp", reason="grimp is not installed (it comes with import-linter)")
    graph = grimp.build_graph("tierkv", exclude_type_checking_imports=False, cache_dir=None)
    mods = {m for m in graph.modules if m.startswith("tierkv.daemon.")}
    edges = {m: {d for d in graph.find_modules_directly_imported_by(m) if d in mods} for m in mods}
    assert _cycles(edges) == []


def test_no_daemon_module_imports_another_for_annotations_only():
    """A daemon module that names another's types imports it: no `if TYPE_CHECKING:` import inside tierkv.daemon
    hides a circle."""
    import ast

    found = []
    for path in sorted((REPO / "tierkv" / "daemon").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)):
                continue
            for inner in ast.walk(node):
                names = ([inner.module or ""] if isinstance(inner, ast.ImportFrom)
                         else [a.name for a in inner.names] if isinstance(inner, ast.Import) else [])
                found += [f"{path.name}: {n}" for n in names if n.startswith("tierkv.daemon")]
    assert found == []


def test_only_a_tiers_manager_writes_its_fields_of_a_block():
    """Every write of a record's tier fields (:data:`~tierkv.cache.block.TIER_FIELDS`) is in that tier's
    manager (``tierkv/cache/<tier>_manager.py``), and nothing there or in the daemon sets attributes by
    name (settings by their dotted names aside): a block's life in a tier is its manager's transitions."""
    import ast

    from tierkv.cache.block import TIER_FIELDS

    owner = {f: tier for tier, fields in TIER_FIELDS.items() for f in fields}
    found = []
    for path in sorted((REPO / "tierkv").rglob("*.py")):
        name = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text(), name)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                if path.parent.name in ("cache", "daemon", "sim") and path.name != "config.py":
                    found.append(f"{name}:{node.lineno}: setattr")
                continue
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])
            for t in targets:
                for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if not isinstance(e, ast.Attribute) or e.attr not in owner:
                        continue
                    if isinstance(e.value, ast.Name) and e.value.id == "self":
                        continue  # a class's own attribute of that name (not a record's)
                    if path.name != f"{owner[e.attr]}_manager.py":
                        found.append(f"{name}:{node.lineno}: {e.attr} ({owner[e.attr]})")
    assert found == []


def test_modules_and_functions_stay_small():
    """Small modules named for one thing: no module of the package over 400 lines, no function over 60."""
    import ast

    big, long_ = [], []
    for path in sorted((REPO / "tierkv").rglob("*.py")):
        text = path.read_text()
        name = str(path.relative_to(REPO))
        if text.count("\n") > 400:
            big.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > 60:
                    long_.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    assert not big, big
    assert not long_, long_


# Module names that several packages use, each with the one thing it means wherever it appears.
SHARED_MODULE_NAMES = {
    "base.py": "the base class of the package's implementations (policies, codecs)",
    "connection.py": "one socket to a server (the daemon's Unix socket; a Redis node)",
    "errors.py": "the package's exceptions",
    "events.py": "KV events (the daemon publishes them; the client's index subscribes)",
    "slots.py": "shared-memory slots (the daemon allocates them; the client leases them)",
    "stats.py": "figures as their readers see them (tierkv stats; vLLM's stats)",
    "tier.py": "a tier's store (disk; remote)",
    "tuning.py": "runtime tuning (its rules; their application to the running daemon)",
}


def test_a_module_name_means_one_thing():
    """A module name used in several packages is one of SHARED_MODULE_NAMES, with the one meaning given there."""
    from collections import Counter

    names = Counter(p.name for p in (REPO / "tierkv").rglob("*.py") if p.name != "__init__.py")
    shared = {n for n, c in names.items() if c > 1}
    assert shared <= set(SHARED_MODULE_NAMES), sorted(shared - set(SHARED_MODULE_NAMES))

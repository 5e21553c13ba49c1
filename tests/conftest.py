"""Shared fixtures: a real daemon process on a temporary socket and data dir."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# vLLM's CPU build binds one OpenMP thread to every core by default; a thread bound to a core that another
# process (the daemon, the test, the other pytest worker) is using holds up the others at every barrier
# (beside one spinning process requests take 3.45x their idle time: tools/bench_vllm_threads.py). The
# suite's servers and in-process engines run one unbound thread; benchmarks keep their own settings.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.helpers import Daemon, has_cuda, start_shared_type_check, start_type_check

VLLM_MODULES = "tests/system/test_vllm"  # the modules that start vLLM's server


def pytest_configure(config: pytest.Config) -> None:
    """The whole suite under pytest-xdist: mypy starts now in the background (a minute at a lower priority,
    beside the first tests) and the worker that runs the type-check test reads its result."""
    whole = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    if whole and getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        start_shared_type_check(Path(tempfile.mkdtemp(prefix="tierkv-mypy-")) / "mypy.out")


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under pytest-xdist (`make test` runs two workers): each module runs whole on one worker, the
    modules that start vLLM's server first (the longest), in collection order."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # collection order: vLLM's modules first (below)
    return LoadScopeScheduling(config, log)


@contextlib.contextmanager
def _machine(exclusive: bool) -> Iterator[None]:
    """Under pytest-xdist: a test marked ``exclusive`` (it needs the other cores idle: what the daemon
    does while the engine leaves them so) runs alone, setup to teardown; any other test shares the
    machine. A turnstile keeps a waiting exclusive test from being starved by the other worker."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield
        return
    base = Path(tempfile.gettempdir()) / f"tierkv-tests-{run}"
    with open(f"{base}.turnstile", "a") as gate, open(f"{base}.machine", "a") as machine:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(machine, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    with _machine(item.get_closest_marker("exclusive") is not None):
        return (yield)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "PYTEST_XDIST_WORKER" in os.environ:
        items.sort(key=lambda item: not item.nodeid.startswith(VLLM_MODULES))  # stable: order kept within
    if "PYTEST_XDIST_WORKER" not in os.environ and any(item.name == "test_the_package_type_checks" for item in items):
        start_type_check()  # a minute of mypy runs beside the tests before it, at a lower priority
    if not has_cuda():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _remove_socket_dirs():
    yield
    for d in Daemon.sockdirs:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon_factory(tmp_path: Path):
    made: list[Daemon] = []

    def make(args: list[str] | None = None, start: bool = True, **kw) -> Daemon:
        d = Daemon(tmp_path / f"d{len(made)}", args, **kw)
        d.workdir.mkdir(parents=True, exist_ok=True)
        made.append(d)
        return d.start() if start else d

    yield make
    for d in made:
        d.stop()
        shutil.rmtree(d.sockdir, ignore_errors=True)


@pytest.fixture
def daemon(daemon_factory) -> Daemon:
    """A running daemon (256 MiB host, 1 GiB disk, 8 MiB slabs) on a temporary socket and data dir."""
    return daemon_factory()

"""tierkv installs as users install it: a wheel built from the tree goes into a fresh venv that has only
torch, and works there without the checkout (the client, the vLLM connector's plain modules, the CUDA
kernel's source, the C extensions, the default settings, and `tierkv serve`)."""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.timeout(600)


def _requirements(dist: str, seen: set[str]) -> None:
    """``dist`` and what it requires (installed ones, without extras), recursively."""
    key = dist.lower().replace("_", "-")
    if key in seen:
        return
    seen.add(key)
    for req in md.distribution(dist).requires or []:
        if "extra ==" in req:
            continue
        name = re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0]
        try:
            md.distribution(name)
        except md.PackageNotFoundError:
            continue
        _requirements(name, seen)


def torch_only_site(dest: Path) -> Path:
    """A directory of links to torch and its requirements as this interpreter has them installed."""
    dest.mkdir()
    dists: set[str] = set()
    _requirements("torch", dists)
    site = Path(md.distribution("torch").locate_file(""))
    for name in dists:
        for f in md.distribution(name).files or []:
            top = f.parts[0]
            if top not in ("..", "bin") and not (dest / top).exists() and (site / top).exists():
                (dest / top).symlink_to(site / top)
    return dest


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, **kw)
    assert r.returncode == 0, f"{cmd[:4]} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


def test_the_wheel_works_in_a_fresh_venv_without_the_checkout(tmp_path):
    run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "wheels")])
    wheel = next((tmp_path / "wheels").glob("tierkv-*.whl"))
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)])
    py = str(venv / "bin" / "python")
    site = Path(run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "torch-only.pth").write_text(str(torch_only_site(tmp_path / "torch-site")) + "\n")
    run([py, "-m", "pip", "install", "-q", str(wheel)])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["TIERKV_NO_REEXEC"] = "1"
    out = run([py, "-c", """
import tierkv, tierkv.client, tierkv.client.events
import tierkv._native._lookup, tierkv._native._ntcopy  # the C extensions, built into the wheel
import tierkv.integrations.vllm.plan, tierkv.integrations.vllm.link, tierkv.integrations.vllm.pages
import tierkv.integrations.vllm.transfer, tierkv.integrations.vllm.committer
from tierkv.client.paged.kernel import kernel_source
from tierkv.ops import replay_cli
assert "TKV_UNROLL" in kernel_source()
assert replay_cli.daemon_config(None).disk.admission == "predicted"
import sys
assert "vllm" not in sys.modules and "lmdb" not in sys.modules and "redis" not in sys.modules
print(tierkv.__file__)
"""], cwd=tmp_path, env=env).stdout
    assert out.strip().startswith(str(venv)), out  # the installed package, not the checkout
    sock, data = tmp_path / "s" / "tierkv.sock", tmp_path / "data"
    sock.parent.mkdir(mode=0o700)
    daemon = subprocess.Popen([py, "-m", "tierkv", "serve", "--socket", str(sock), "--data-dir", str(data),
                               "--host-capacity", "64MiB", "--disk-capacity", "256MiB", "--slab-bytes", "8MiB"],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            r = subprocess.run([py, "-m", "tierkv", "ping", "--socket", str(sock)], cwd=tmp_path, env=env,
                               capture_output=True, text=True)
            if r.returncode == 0:
                break
            assert daemon.poll() is None and time.monotonic() < deadline, r.stderr
            time.sleep(0.5)
    finally:
        daemon.terminate()
        assert daemon.wait(60) == 0

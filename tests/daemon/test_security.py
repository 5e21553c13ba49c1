"""Security: local and closed by default.

Peer credentials are checked before a byte is parsed; pre-created or symlinked paths are refused; the
pool is a sealed memfd, not a named segment; no TCP/UDP socket is opened; a pickle is just a bad frame;
and neither the linter nor a scan of the source finds unsafe deserialisation anywhere under tierkv/.
"""

from __future__ import annotations

import ast
import fcntl
import os
import socket
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from tests.helpers import FAST_ENV, REPO, SMALL, RawClient, _send_and_close, shm_held_by, wait_for
from tierkv.core import protocol
from tierkv.core.errors import PermissionDenied, TierKVError
from tierkv.core.keys import Namespace
from tierkv.core.protocol import HEADER, Op
from tierkv.daemon.config import load_config
from tierkv.daemon.server import Server

NOBODY = 65534
STRANGER = 65533


# ---- peer credentials ------------------------------------------------------------------------------
def _as_uid(uid: int, path: str, frame: bytes) -> bytes:
    """Fork; the child drops to ``uid``, connects, sends ``frame`` and reports what came back.

    Returns b"refused-connect" when the socket could not be opened, otherwise the reply frame, or what
    came before the daemon closed the connection (b"" means closed without a word).
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no imports, no locks, only syscalls
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            try:
                s.connect(path)
            except PermissionError:
                os.write(w, b"refused-connect")
                os._exit(0)
            got = b""
            try:
                s.sendall(frame)
            except (BrokenPipeError, ConnectionResetError):
                os.write(w, got)  # closed before we could even send: refused without a word
                os._exit(0)
            # until the daemon closes, or one whole reply frame has arrived
            while len(got) < 16 or len(got) < 16 + int.from_bytes(got[12:16], "little"):
                try:
                    chunk = s.recv(4096)
                except ConnectionResetError:
                    break
                if not chunk:
                    break
                got += chunk
            os.write(w, got)
            os._exit(0)
        except BaseException as exc:  # anything at all: report it through the pipe
            os.write(w, f"child error: {exc!r}".encode())
            os._exit(1)
    os.close(w)
    out = b""
    while chunk := os.read(r, 65536):
        out += chunk
    os.close(r)
    _pid, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out
    return out


@pytest.fixture
def open_daemon(daemon_factory):
    """A daemon that allows uid 65534 besides its own, with socket permissions opened up after start-up,
    so that only SO_PEERCRED stands between another uid and the protocol."""
    if os.getuid() != 0:
        pytest.skip("needs root to connect as other uids")
    d = daemon_factory(env={**FAST_ENV, "TIERKV_SERVER_ALLOW_UIDS": str(NOBODY)})
    os.chmod(os.path.dirname(d.socket), 0o755)
    os.chmod(d.socket, 0o666)
    return d


def test_other_uid_refused_by_peer_credentials(open_daemon):
    d = open_daemon
    ping = protocol.pack(Op.PING, 1, {})
    got = _as_uid(NOBODY, d.socket, ping)  # allowed by server.allow_uids: served
    assert got and protocol.parse_header(got[:16], 1 << 20)[1] == protocol.STATUS_OK
    got = _as_uid(STRANGER, d.socket, ping)  # not allowed: closed before a byte is read
    assert got == b""
    got = _as_uid(STRANGER, d.socket, b"XX" + b"\x00" * 14)  # a bad frame would get an error reply if parsed
    assert got == b""
    assert wait_for(lambda: f"uid {STRANGER}" in d.log.read_text(), timeout=5)  # refusals are logged
    assert "bad frame magic" not in d.log.read_text()
    rc = RawClient(d.socket)
    assert rc.ok(Op.PING)["pong"]  # the daemon is unaffected
    rc.close()


def test_default_socket_permissions_keep_other_uids_out(daemon_factory):
    if os.getuid() != 0:
        pytest.skip("needs root to connect as another uid")
    d = daemon_factory(env={**FAST_ENV, "TIERKV_SERVER_ALLOW_UIDS": str(NOBODY)})
    # 0600 socket in a 0700 dir: even an allowed uid cannot open it unless the operator opens the path
    assert _as_uid(NOBODY, d.socket, protocol.pack(Op.PING, 1, {})) == b"refused-connect"


# ---- paths -----------------------------------------------------------------------------------------
def _startup(sock: Path, data: Path) -> None:
    """Run the daemon's start-up checks in-process (a small pool, no disk scan cost) and tear it down."""
    cfg = load_config(env={}, overrides={"server.socket": str(sock), "server.data_dir": str(data),
                                         "host.capacity": "1MiB", "host.slab_bytes": "1MiB",
                                         "host.prefault": False, "disk.capacity": "16MiB"})
    srv = Server(cfg)
    try:
        srv.startup()
    finally:
        srv.shutdown()


def _private_dir(p: Path) -> Path:
    p.mkdir(mode=0o700)
    os.chmod(p, 0o700)
    return p


@pytest.mark.parametrize("case", ["regular file", "symlink to a file", "symlink to a socket", "fifo"])
def test_precreated_socket_path_refused(tmp_path, case):
    sockdir = _private_dir(tmp_path / "run")
    sock = sockdir / "s"
    target = tmp_path / "target"
    target.write_text("precious")
    if case == "regular file":
        sock.write_text("precious")
    elif case == "symlink to a file":
        sock.symlink_to(target)
    elif case == "symlink to a socket":
        other = socket.socket(socket.AF_UNIX)
        other.bind(str(tmp_path / "real.sock"))
        other.close()
        sock.symlink_to(tmp_path / "real.sock")
    else:
        os.mkfifo(sock)
    with pytest.raises(PermissionDenied, match="not a socket"):
        _startup(sock, tmp_path / "data")
    assert os.path.lexists(sock) and target.read_text() == "precious"  # nothing was removed or followed


@pytest.mark.parametrize("case", ["symlink", "other owner", "world writable", "sticky like /tmp"])
def test_unsafe_socket_dir_or_data_dir_refused(tmp_path, case):
    for which in ("socket dir", "data dir"):
        root = _private_dir(tmp_path / which.replace(" ", "-"))
        real = _private_dir(root / "real")
        bad = root / "bad"
        if case == "symlink":
            bad.symlink_to(real)
        else:
            bad.mkdir()
            if case == "other owner":
                os.chown(bad, NOBODY, NOBODY)
                if os.stat(bad).st_uid != NOBODY:
                    pytest.skip("cannot chown here")
                os.chmod(bad, 0o700)
            else:
                os.chmod(bad, 0o777 if case == "world writable" else 0o1777)
        sock, data = (bad / "s", root / "data") if which == "socket dir" else (real / "s", bad)
        with pytest.raises(PermissionDenied):
            _startup(sock, data)
        assert not os.path.exists(sock), which


def test_live_socket_is_not_stolen_and_stale_one_is_replaced(daemon_factory, tmp_path):
    d = daemon_factory(env=FAST_ENV)
    with pytest.raises(TierKVError, match="another daemon"):
        _startup(Path(d.socket), tmp_path / "data")
    rc = RawClient(d.socket)  # the running daemon keeps its socket
    assert rc.ok(Op.PING)["pong"]
    rc.close()
    stale_dir = _private_dir(tmp_path / "run")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(stale_dir / "s"))  # a socket file nobody listens on: what kill -9 leaves behind
    stale.close()
    _startup(stale_dir / "s", tmp_path / "data2")  # accepted: replaced, then removed on shutdown
    assert not os.path.exists(stale_dir / "s")


def test_refusal_is_one_line_without_traceback(tmp_path):
    sockdir = _private_dir(tmp_path / "run")
    (sockdir / "s").write_text("not a socket")
    r = subprocess.run([sys.executable, "-m", "tierkv", "serve", "--socket", str(sockdir / "s"),
                        "--data-dir", str(tmp_path / "data"), "--host-capacity", "8MiB", "--slab-bytes", "1MiB"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, **FAST_ENV})
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and "not a socket" in r.stderr


def test_symlinked_disk_subdir_refused(tmp_path):
    data = _private_dir(tmp_path / "data")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o777)
    os.chmod(elsewhere, 0o777)
    (data / "disk").symlink_to(elsewhere)
    with pytest.raises(PermissionDenied):
        _startup(_private_dir(tmp_path / "run") / "s", data)


def test_existing_lmdb_files_are_made_private(tmp_path):
    data = _private_dir(tmp_path / "data")
    env = lmdb.open(str(data / "disk"), subdir=True, mode=0o644, map_size=1 << 20)
    env.close()
    _startup(_private_dir(tmp_path / "run") / "s", data)
    for name in ("data.mdb", "lock.mdb"):
        assert os.stat(data / "disk" / name).st_mode & 0o077 == 0, name


# ---- what the daemon exposes ---------------------------------------------------------------------------
def _inet_inodes() -> set[str]:
    inodes = set()
    for table in ("tcp", "tcp6", "udp", "udp6"):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        inodes |= {line.split()[9] for line in lines if len(line.split()) > 9}
    return inodes


def _fd_links(pid: int) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass  # closed meanwhile
    return out


def test_no_network_listener_and_a_sealed_memfd_pool(daemon_factory):
    d = daemon_factory(env=FAST_ENV)
    rc = RawClient(d.socket)
    try:
        assert rc.hello(Namespace("test-model", SMALL), keep_fd=True)[0] == protocol.STATUS_OK
        fd = rc.pool_fd
        assert fd is not None
        # a hostile client cannot shrink or grow the pool under the daemon (that would SIGBUS it)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        # the daemon's sockets are all Unix sockets
        socks = {link[8:-1] for link in _fd_links(d.proc.pid) if link.startswith("socket:[")}
        assert socks and not socks & _inet_inodes()
        assert shm_held_by(d.proc.pid) == set()  # no named shared memory
        assert not [n for n in os.listdir("/dev/shm") if n.lower().startswith("tierkv")]
    finally:
        rc.close()


# ---- pickle is a bad frame ----------------------------------------------------------------------------
def _rce(marker: Path) -> list[bytes]:
    """Pickles that would create ``marker`` if anything unpickled them (built by hand: no pickle import)."""
    cmd = f"touch {marker}".encode()
    proto0 = b"cos\nsystem\n(S'" + cmd + b"'\ntR."
    proto2 = (b"\x80\x02cposix\nsystem\nq\x00X" + len(cmd).to_bytes(4, "little") + cmd + b"q\x01\x85q\x02Rq\x03.")
    return [proto0, proto2]


def test_pickle_payloads_are_bad_frames(daemon_factory, tmp_path):
    d = daemon_factory(env=FAST_ENV)
    marker = tmp_path / "pwned"
    for payload in _rce(marker):
        for op in (Op.PING, Op.HELLO, Op.COMMIT, Op.STATS):
            data = _send_and_close(d.socket, HEADER.pack(b"TK", protocol.VERSION, 0, op, 0, 1, len(payload)) + payload)
            if data:  # an error reply, then the connection is closed
                _op, status, _rid, length = protocol.parse_header(data[:16], 1 << 20)
                assert status == protocol.STATUS_ERROR
                assert protocol.unpack_body(data[16:16 + length], 1 << 20)["code"] == "protocol"
        data = _send_and_close(d.socket, payload)  # a bare pickle stream: not even a frame
        assert data == b"" or protocol.parse_header(data[:16], 1 << 20)[1] == protocol.STATUS_ERROR
        rc = RawClient(d.socket)  # inside msgpack a pickle is just opaque key bytes
        try:
            rc.hello(Namespace("test-model", SMALL))
            status, _ = rc.call(Op.LOOKUP, {"keys": [payload[:128]]})
            assert status == protocol.STATUS_OK
        finally:
            rc.close()
    # a pickle planted as a stored value is a corrupt block, dropped at start-up
    d.stop()
    env = lmdb.open(os.path.join(d.data_dir, "disk"), subdir=True)
    with env.begin(write=True) as txn:
        txn.put(Namespace("test-model", SMALL).fingerprint + b"k" * 16, _rce(marker)[1])
    env.close()
    d.start()
    assert d.stats()["tiers"]["disk"]["corrupt"] == 1
    assert not marker.exists(), "something unpickled a payload"


# ---- lint and source scan ------------------------------------------------------------------------------
def _ruff(*args: str) -> subprocess.CompletedProcess:
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.skip("ruff is not installed in this environment")
    return subprocess.run([str(ruff), "check", "--no-cache", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_ruff_clean_with_the_project_config():
    r = _ruff("tierkv", "tests", "tools")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_ruff_unsafe_deserialisation_rules():
    # S403 (pickle imports) is a preview rule in ruff 0.17: without --preview the project config's
    # selection of it has no effect, so it is switched on here.
    r = _ruff("--preview", "--select", "S301,S302,S307,S403,S506", "tierkv", "tools")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle"}
UNSAFE_YAML = {"load", "load_all", "unsafe_load", "unsafe_load_all"}


def _call_name(node: ast.Call) -> str:
    parts = []
    f = node.func
    while isinstance(f, ast.Attribute):
        parts.append(f.attr)
        f = f.value
    if isinstance(f, ast.Name):
        parts.append(f.id)
    return ".".join(reversed(parts))


def _kw(node: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in node.keywords if k.arg == name), None)


def unsafe_deserialisation(source: str, filename: str = "<src>") -> list[str]:
    """Findings in one source file: unsafe modules imported (statically or by name), ``yaml.load``,
    ``torch.load`` without ``weights_only=True``, ``numpy.load`` with ``allow_pickle=True``."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        line = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            out += [f"{line}: import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            out.append(f"{line}: from {node.module} import ...")
        elif isinstance(node, ast.ImportFrom) and node.module == "yaml":
            out += [f"{line}: from yaml import {a.name}" for a in node.names if a.name in UNSAFE_YAML]
        elif isinstance(node, ast.Call):
            name = _call_name(node)
            first = node.args[0] if node.args else None
            if name in ("__import__", "importlib.import_module", "import_module") and isinstance(first, ast.Constant) \
                    and str(first.value).split(".")[0] in UNSAFE_MODULES:
                out.append(f"{line}: {name}({first.value!r})")
            if name.split(".")[-2:-1] == ["yaml"] and name.split(".")[-1] in UNSAFE_YAML:
                out.append(f"{line}: {name}(")
            if name.endswith("torch.load"):
                wo = _kw(node, "weights_only")
                if not (isinstance(wo, ast.Constant) and wo.value is True):
                    out.append(f"{line}: torch.load( without weights_only=True")
            if name in ("np.load", "numpy.load"):
                ap = _kw(node, "allow_pickle")
                if ap is not None and not (isinstance(ap, ast.Constant) and ap.value is False):
                    out.append(f"{line}: {name}(allow_pickle=...)")
    return out


def test_source_scan_finds_no_unsafe_deserialisation():
    files = sorted((REPO / "tierkv").rglob("*.py"))
    assert len(files) > 20
    findings = [f for p in files for f in unsafe_deserialisation(p.read_text(), str(p.relative_to(REPO)))]
    assert findings == []


def test_source_scan_catches_what_it_should():
    bad = ("import pickle\nimport marshal as m\nfrom dill import loads\n__import__('pickle')\n"
           "import importlib\nimportlib.import_module('shelve')\nimport yaml\nyaml.load(s)\n"
           "import torch\ntorch.load(p)\ntorch.load(p, weights_only=False)\nimport numpy as np\n"
           "np.load(p, allow_pickle=True)\nfrom yaml import unsafe_load\n")
    assert len(unsafe_deserialisation(bad)) == 10
    good = ("import torch\ntorch.load(p, weights_only=True)\nimport numpy as np\nnp.load(p, allow_pickle=False)\n"
            "import yaml\nyaml.safe_load(s)\n")
    assert unsafe_deserialisation(good) == []

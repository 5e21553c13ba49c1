"""Real redis-server (or valkey-server) processes for tests, on free loopback ports in temp dirs.

A standalone server, a three-primary cluster (``redis-cli --cluster create``), ACL users, ``maxmemory``
variants, a Unix socket and TLS. Every process is stopped and its directory removed by the fixture that
made it (and, as a last resort, when the interpreter exits).

Use from a test module (assigning the fixtures makes them visible to pytest there)::

    from tests import redis_servers
    from tests.redis_servers import need_redis

    redis_factory = redis_servers.redis_factory

    @need_redis
    def test_x(redis_factory):
        srv = redis_factory(maxmemory="4mb", policy="noeviction")
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
VALKEY_SERVER = shutil.which("valkey-server")
VALKEY_CLI = shutil.which("valkey-cli")
OPENSSL = shutil.which("openssl")

_skip_no_redis = pytest.mark.skipif(not (REDIS_SERVER and REDIS_CLI),
                                    reason="redis-server/redis-cli not on PATH (tools/ensure_services.sh installs them)")
_skip_no_valkey = pytest.mark.skipif(not (VALKEY_SERVER and VALKEY_CLI),
                                     reason="valkey-server/valkey-cli not on PATH (not packaged for this distribution)")


def need_redis(fn):
    """Mark a test ``redis`` and skip it, with the reason, where redis-server is not on PATH."""
    return pytest.mark.redis(_skip_no_redis(fn))


def need_valkey(fn):
    """Mark a test ``redis`` and skip it where valkey-server is not on PATH."""
    return pytest.mark.redis(_skip_no_valkey(fn))


# What the remote tier needs; the cluster rows are for topology discovery by redis-py.
ACL_COMMANDS = ("+get", "+set", "+exists", "+unlink", "+del", "+ping", "+info", "+cluster|slots", "+cluster|shards",
                "+cluster|nodes", "+command")

# The user the fixtures' servers define for the tier: only tierkv:* keys and ACL_COMMANDS.
ACL_USER, ACL_PASSWORD = "tierkv", "s3cret"
ACL_RULE = f"{ACL_USER} on >{ACL_PASSWORD} ~tierkv:* resetchannels -@all " + " ".join(ACL_COMMANDS)

_LIVE: set[RedisServer] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, outside the kernel's ephemeral range.

    A port the kernel hands out for ``bind(0)`` is also what it hands to outgoing connections (the
    suite's clients, other jobs on the machine), so a server started on it a moment later can find it
    taken: CI once lost a cluster bus port that way. Ports below the ephemeral range are only ever
    taken by a listener, and one process never gets the same port twice.
    """
    lo, _hi = _ephemeral_range()
    top = max(lo - 1, 20000)
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(1000):
        port = rng.randrange(10000, top)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free TCP port in 10000..{top}")


class _PortTaken(RuntimeError):
    """The server could not bind one of its ports."""


@dataclass(frozen=True)
class TlsFiles:
    """A throwaway CA and a server certificate for 127.0.0.1."""

    ca: Path
    cert: Path
    key: Path


def make_tls_files(directory: Path) -> TlsFiles | None:
    """Create a CA and a server cert (EC P-256, valid one day) with openssl; None if that fails."""
    if not OPENSSL:
        return None
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    steps = [
        [OPENSSL, "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=tierkv test CA"],
        [OPENSSL, "req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1"],
        [OPENSSL, "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "server.crt", "-days", "1", "-extfile", "san.cnf"],
    ]
    for cmd in steps:
        if subprocess.run(cmd, cwd=d, capture_output=True, timeout=30).returncode != 0:
            return None
    return TlsFiles(d / "ca.crt", d / "server.crt", d / "server.key")


class RedisServer:
    """One redis-server process with its own directory, config file and log.

    Args:
        binary: the server executable (redis-server or valkey-server).
        cli: the matching command-line client.
        maxmemory: e.g. ``"8mb"``; with ``policy`` (``noeviction``, ``allkeys-lru``, ...).
        users: ACL user lines without the leading ``user`` (e.g. ``"tierkv on >pw ~tierkv:* +get"``).
        unixsocket: also listen on ``<dir>/redis.sock`` (mode 0700).
        tls: serve TLS on a second port with these files.
        cluster: cluster mode (``cluster-enabled yes``, its own bus port).
        extra: more config directives.
    """

    def __init__(self, *, binary: str | None = None, cli: str | None = None, maxmemory: str | None = None,
                 policy: str | None = None, users: list[str] | tuple[str, ...] = (), unixsocket: bool = False,
                 tls: TlsFiles | None = None, cluster: bool = False, extra: dict[str, str] | None = None) -> None:
        self.binary = binary or REDIS_SERVER
        self.cli_binary = cli or REDIS_CLI
        if not self.binary or not self.cli_binary:
            raise RuntimeError("redis-server/redis-cli not found")
        # /tmp keeps the Unix socket path well under the 107-byte limit.
        self.dir = Path(tempfile.mkdtemp(prefix="tkv-redis-", dir="/tmp"))
        self.socket_path = str(self.dir / "redis.sock") if unixsocket else None
        self.tls = tls
        self._opts = dict(maxmemory=maxmemory, policy=policy, users=tuple(users), unixsocket=unixsocket,
                          cluster=cluster, extra=dict(extra or {}))
        self.started_once = False
        self._write_conf()
        self.proc: subprocess.Popen | None = None

    def _write_conf(self) -> None:
        """Pick fresh ports and write the config file for them."""
        o, tls = self._opts, self.tls
        maxmemory, policy, users, unixsocket, cluster, extra = (o["maxmemory"], o["policy"], o["users"],
                                                                o["unixsocket"], o["cluster"], o["extra"])
        (self.dir / "redis.log").unlink(missing_ok=True)  # a failed try's log must not speak for the next
        self.port = free_port()
        self.tls_port = free_port() if tls else None
        self.bus_port = free_port() if cluster else None
        lines = [f"port {self.port}", "bind 127.0.0.1", "daemonize no", "save \"\"", "appendonly no",
                 f"dir {self.dir}", f"logfile {self.dir / 'redis.log'}", "loglevel warning"]
        if maxmemory:
            lines.append(f"maxmemory {maxmemory}")
        if policy:
            lines.append(f"maxmemory-policy {policy}")
        for u in users:
            lines.append(f"user {u}")
        if unixsocket:
            lines += [f"unixsocket {self.socket_path}", "unixsocketperm 700"]
        if tls:
            lines += [f"tls-port {self.tls_port}", f"tls-cert-file {tls.cert}", f"tls-key-file {tls.key}",
                      f"tls-ca-cert-file {tls.ca}", "tls-auth-clients no"]
        if cluster:
            lines += ["cluster-enabled yes", f"cluster-config-file {self.dir / 'nodes.conf'}",
                      "cluster-node-timeout 3000", f"cluster-port {self.bus_port}"]
        for k, v in (extra or {}).items():
            lines.append(f"{k} {v}")
        self.conf = self.dir / "redis.conf"
        self.conf.write_text("\n".join(lines) + "\n")

    # ---- lifecycle ------------------------------------------------------------------------------------
    def start(self, timeout: float = 15.0) -> RedisServer:
        """Start (or restart on the same port and config) and wait until it answers PING.

        A first start that loses a port to another process (bind: address in use) moves to fresh ports
        and tries again; a restart keeps its ports, since tests reconnect to them.
        """
        for attempt in range(5):
            try:
                self._start_once(timeout)
                self.started_once = True
                return self
            except _PortTaken:
                if self.started_once or attempt == 4:
                    raise
                self._write_conf()
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> None:
        self.proc = subprocess.Popen([self.binary, str(self.conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        _LIVE.add(self)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                err = _PortTaken if "Address already in use" in tail else RuntimeError
                raise err(f"{self.binary} exited with {self.proc.returncode}: {tail}")
            if self._pong():
                return
            time.sleep(0.02)
        raise RuntimeError(f"{self.binary} did not answer PING within {timeout}s: {self.log_tail()}")

    def _pong(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the server (a crash); the directory stays so it can be restarted."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the port accepts connections but nothing answers (a partition or a hung server)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Stop the process (SIGKILL after 5 s of SIGTERM) and remove the directory."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.terminate()
                self.proc.wait(5)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                self.proc.kill()
                self.proc.wait(5)
        _LIVE.discard(self)
        shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self, n: int = 2000) -> str:
        try:
            return (self.dir / "redis.log").read_text()[-n:]
        except OSError:
            return ""

    # ---- access ---------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        assert self.socket_path, "started without unixsocket=True"
        return f"unix://{self.socket_path}?db=0"

    @property
    def tls_url(self) -> str:
        assert self.tls is not None, "started without tls"
        return (f"rediss://127.0.0.1:{self.tls_port}/0?ssl_cert_reqs=required&ssl_ca_certs={self.tls.ca}")

    def admin(self, **kw):
        """A redis-py client as the default (all-powerful) user."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, protocol=2, **kw)

    def cli(self, *args: str, check: bool = True) -> str:
        """Run the command-line client against this server; its stdout."""
        r = subprocess.run([self.cli_binary, "-h", "127.0.0.1", "-p", str(self.port), *args], capture_output=True,
                           text=True, timeout=30)
        if check and r.returncode != 0:
            raise RuntimeError(f"{self.cli_binary} {' '.join(args)}: {r.stderr or r.stdout}")
        return r.stdout


class RedisClusterServers:
    """``n`` cluster-mode servers joined as primaries (no replicas) with ``--cluster create``."""

    def __init__(self, n: int = 3, **server_kw) -> None:
        if n < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 primaries")
        self.nodes = [RedisServer(cluster=True, **server_kw) for _ in range(n)]

    def start(self, timeout: float = 30.0) -> RedisClusterServers:
        for s in self.nodes:
            s.start()
        first = self.nodes[0]
        addrs = [f"127.0.0.1:{s.port}" for s in self.nodes]
        r = subprocess.run([first.cli_binary, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                           capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"cluster create failed: {r.stdout[-2000:]} {r.stderr[-2000:]}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self._ok(s) for s in self.nodes):
                return self
            time.sleep(0.05)
        raise RuntimeError("cluster did not reach cluster_state:ok")

    def _ok(self, s: RedisServer) -> bool:
        info = dict(line.split(":", 1) for line in s.cli("cluster", "info", check=False).splitlines() if ":" in line)
        return (info.get("cluster_state", "").strip() == "ok" and info.get("cluster_slots_ok", "").strip() == "16384"
                and info.get("cluster_known_nodes", "").strip() == str(len(self.nodes)))

    @property
    def url(self) -> str:
        """A seed list for the remote tier: ``redis+cluster://h:p,h:p,h:p``."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.nodes)

    def stop(self) -> None:
        for s in self.nodes:
            s.stop()


@atexit.register
def _stop_leftovers() -> None:
    for s in list(_LIVE):
        s.stop()


# ---- fixtures -------------------------------------------------------------------------------------------


@pytest.fixture
def redis_factory() -> Iterator:
    """Make started servers: ``redis_factory(maxmemory="4mb", policy="noeviction", users=[...])``."""
    made: list[RedisServer] = []

    def make(**kw) -> RedisServer:
        s = RedisServer(**kw)
        made.append(s)
        return s.start()

    yield make
    for s in made:
        s.stop()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """One standalone server (with a Unix socket) shared by a test module; flush it if a test needs it empty."""
    s = RedisServer(unixsocket=True).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisClusterServers]:
    """A three-primary cluster shared by a test module; its nodes define the ACL user ``ACL_RULE``."""
    c = RedisClusterServers(3, users=[ACL_RULE])
    try:
        c.start()
    except BaseException:
        c.stop()
        raise
    yield c
    c.stop()

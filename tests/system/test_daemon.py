"""Integration tests: a real daemon process driven by clients in this and other processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

import tierkv
import tierkv.client.durable
from tests.helpers import SMALL, RawClient, keys_for, rand_blocks, wait_for
from tierkv.core import protocol
from tierkv.core.errors import BadRequest, KeyMissing, ProtocolError, TierKVError
from tierkv.core.protocol import Op
from tierkv.daemon.config import load_config
from tierkv.daemon.server import Server


def test_round_trip_host(daemon):
    with daemon.client() as c:
        keys = keys_for(c, 8)
        blocks = rand_blocks(8)
        assert c.lookup(keys) == 0
        assert c.put(keys, blocks) == 8
        assert c.lookup(keys) == 8
        assert c.lookup_tiers(keys) == ["host"] * 8
        got = c.get(keys)
        assert torch.equal(got.view(torch.int16), blocks.view(torch.int16))
        st = c.stats()
        assert st["tiers"]["host"]["blocks"] == 8
        assert st["tiers"]["host"]["hits"] >= 8


def test_keys_chain_over_prefix(daemon):
    with daemon.client() as c:
        toks = list(range(100))
        k1 = c.block_keys(toks)
        assert len(k1) == 6
        assert c.block_keys(toks[:48]) == k1[:3]  # equal prefix -> equal keys
        assert c.block_keys(toks[48:96], parent=k1[2]) == k1[3:6]
        other = c.block_keys([1] + toks[1:])
        assert all(a != b for a, b in zip(other, k1))  # a change early changes every later key


def test_zero_copy_alloc_commit_acquire(daemon):
    with daemon.client() as c:
        keys = keys_for(c, 4, seed=3)
        blocks = rand_blocks(4, seed=3)
        with c.alloc(4) as slots:
            for i, v in enumerate(slots.views):
                v.copy_(blocks[i])
            assert slots.commit(keys) == 4
        with c.acquire(keys) as lease:
            assert lease.count == 4 and lease.tiers == ["host"] * 4
            for i, v in enumerate(lease.views):
                assert torch.equal(v.view(torch.int16), blocks[i].view(torch.int16))
        assert c.stats()["leases"] == 0


def test_dedup(daemon):
    with daemon.client() as a, daemon.client() as b:
        keys = keys_for(a, 5, seed=4)
        assert a.put(keys, rand_blocks(5, seed=4)) == 5
        assert b.put(keys, rand_blocks(5, seed=99)) == 0  # same keys: deduplicated, first copy kept
        assert torch.equal(b.get(keys).view(torch.int16), rand_blocks(5, seed=4).view(torch.int16))
        st = a.stats()
        assert st["tiers"]["host"]["blocks"] == 5
        assert list(st["namespaces"].values())[0]["blocks"] == 5


def test_namespaces_isolated(daemon):
    other = tierkv.Layout(2, 2, 32, 16, "float16")
    with daemon.client() as a, daemon.client(layout=other) as b, daemon.client(model="other") as c:
        toks = list(range(64))
        ka, kb, kc = a.block_keys(toks), b.block_keys(toks), c.block_keys(toks)
        assert ka != kb and ka != kc
        a.put(ka, rand_blocks(4))
        assert b.lookup(ka) == 0  # another namespace never sees these blocks, even with the same keys
        assert c.lookup(ka) == 0
        assert len(a.stats()["namespaces"]) == 3


def _writer(sock: str, seed: int, n: int, q) -> None:
    with tierkv.Client.connect(sock, model="test-model", layout=SMALL) as c:
        keys = keys_for(c, n, seed=seed)
        c.put(keys, rand_blocks(n, seed=seed))
        got = c.get(keys)
        q.put(bool(torch.equal(got.view(torch.int16), rand_blocks(n, seed=seed).view(torch.int16))))


def test_concurrent_clients_other_processes(daemon):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(daemon.socket, s, 20, q)) for s in range(4)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert results == [True] * 4
    assert daemon.stats()["tiers"]["host"]["blocks"] == 80


def test_eviction_host_to_disk_and_back(daemon_factory):
    big = tierkv.Layout(4, 4, 64, 16, "bfloat16")  # 64 KiB blocks
    d = daemon_factory(["--host-capacity", "16MiB", "--slab-bytes", "1MiB"], env={"TIERKV_DISK_ADMISSION": "all"})
    with d.client(layout=big) as c:
        n = 300  # 18.75 MiB through a 16 MiB host tier
        keys = keys_for(c, n, seed=5)
        blocks = rand_blocks(n, big, seed=5)
        for i in range(0, n, 20):
            c.put(keys[i:i + 20], blocks[i:i + 20])
        deadline = time.time() + 30
        while time.time() < deadline:
            st = c.stats()
            if st["tiers"]["disk"]["blocks"] > 0 and st["tiers"]["host"]["used_bytes"] <= 16 << 20:
                break
            time.sleep(0.1)
        st = c.stats()
        assert st["tiers"]["host"]["used_bytes"] <= st["tiers"]["host"]["capacity_bytes"]
        assert st["tiers"]["disk"]["blocks"] > 0 and st["tiers"]["host"]["demotions"] > 0
        tiers = c.lookup_tiers(keys)
        assert len(tiers) == n and "disk" in tiers
        for i in range(0, n, 25):  # loads back through promotion, bit-exact
            got = c.get(keys[i:i + 25])
            assert torch.equal(got.view(torch.int16), blocks[i:i + 25].view(torch.int16))
        assert c.stats()["tiers"]["disk"]["hits"] > 0


def test_restart_persistence(daemon):
    with daemon.client() as c:
        dkeys = keys_for(c, 6, seed=6)
        c.put(dkeys, rand_blocks(6, seed=6), durable=True)
        hkeys = keys_for(c, 3, seed=7)
        c.put(hkeys, rand_blocks(3, seed=7))  # not durable: flushed by the graceful shutdown
    assert daemon.stop() == 0
    assert not os.path.exists(daemon.socket)
    daemon.start()
    with daemon.client() as c:
        assert c.lookup_tiers(dkeys) == ["disk"] * 6
        assert torch.equal(c.get(dkeys).view(torch.int16), rand_blocks(6, seed=6).view(torch.int16))
        assert torch.equal(c.get(hkeys).view(torch.int16), rand_blocks(3, seed=7).view(torch.int16))


def test_a_latent_layout_is_its_own_namespace_through_host_disk_and_a_restart(daemon):
    """MLA blocks (one latent vector per token, no V) beside K/V blocks of the same byte size: each kind
    reads back its own bytes from host memory and, after a restart, from disk; neither finds the other."""
    latent = tierkv.Layout(2, 1, 64, 16, "bfloat16", kind="latent")
    kv = tierkv.Layout(2, 1, 32, 16, "bfloat16")
    assert latent.block_bytes == kv.block_bytes
    with daemon.client(layout=latent) as c, daemon.client(layout=kv) as d:
        lkeys, kkeys = c.block_keys(list(range(64))), d.block_keys(list(range(64)))
        assert lkeys != kkeys
        lat, kvb = rand_blocks(4, latent, seed=11), rand_blocks(4, kv, seed=12)
        c.put(lkeys, lat, durable=True)
        d.put(kkeys, kvb, durable=True)
        assert c.lookup(kkeys) == 0 and d.lookup(lkeys) == 0
        assert torch.equal(c.get(lkeys).view(torch.int16), lat.view(torch.int16))
    daemon.stop()
    daemon.start()
    with daemon.client(layout=latent) as c, daemon.client(layout=kv) as d:
        assert c.lookup_tiers(lkeys) == ["disk"] * 4
        assert torch.equal(c.get(lkeys).view(torch.int16), lat.view(torch.int16))
        assert torch.equal(d.get(kkeys).view(torch.int16), kvb.view(torch.int16))


def test_durable_survives_kill9(daemon):
    with daemon.client() as c:
        keys = keys_for(c, 5, seed=8)
        c.put(keys, rand_blocks(5, seed=8), durable=True)
    daemon.kill()
    daemon.start()
    with daemon.client() as c:
        assert torch.equal(c.get(keys).view(torch.int16), rand_blocks(5, seed=8).view(torch.int16))


def test_large_durable_put_streams_in_chunks_and_survives_kill9(daemon, monkeypatch):
    """A durable put larger than a chunk commits chunk by chunk without waiting (the next copy overlaps
    the disk write), then one SYNC waits for all: acknowledged means on disk."""
    monkeypatch.setattr(tierkv.client.durable, "DURABLE_CHUNK_BYTES", 4 * SMALL.block_bytes)
    with daemon.client() as c:
        keys, blocks = keys_for(c, 30, seed=40), rand_blocks(30, seed=40)
        before = c.stats()["requests"]
        assert c.put(keys, blocks, durable=True) == 30
        chunks = tierkv.client.durable.durable_chunks(30, SMALL.block_bytes)
        assert len(chunks) == 7  # 4 blocks a chunk; the 2-block tail rides with the last
        assert c.stats()["requests"] - before == len(chunks) * 2 + 1 + 1  # ALLOC + COMMIT per chunk, SYNC, stats
        assert c.put(keys, blocks, durable=True) == 0  # cached already: still made durable, nothing new
        assert c._call(protocol.Op.SYNC, {}) == {}  # nothing pending
        with pytest.raises(BadRequest, match="wait"):
            c._call(protocol.Op.COMMIT, {"keys": [], "slots": [], "durable": True, "wait": "no"})
    daemon.kill()
    daemon.start()
    with daemon.client() as c:
        assert torch.equal(c.get(keys).view(torch.int16), blocks.view(torch.int16))


def test_streamed_durable_put_failure_is_reported_once(daemon_factory, monkeypatch):
    monkeypatch.setattr(tierkv.client.durable, "DURABLE_CHUNK_BYTES", 2 * SMALL.block_bytes)
    d = daemon_factory(env={"TIERKV_FAULTS": "write:EIO"})
    with d.client() as c:
        keys, blocks = keys_for(c, 7, seed=41), rand_blocks(7, seed=41)
        with pytest.raises(TierKVError, match="I/O"):
            c.put(keys, blocks, durable=True)  # never acknowledged
        other = keys_for(c, 3, seed=42)
        assert c.put(other, rand_blocks(3, seed=42)) == 3  # no stale failure reported by a later call
        assert c._call(protocol.Op.SYNC, {}) == {}
        assert torch.equal(c.get(other).view(torch.int16), rand_blocks(3, seed=42).view(torch.int16))


def _hold_and_die(sock: str, keys_seed: int, ready) -> None:
    c = tierkv.Client.connect(sock, model="test-model", layout=SMALL)
    keys = keys_for(c, 4, seed=keys_seed)
    c.put(keys, rand_blocks(4, seed=keys_seed))
    c.acquire(keys)
    c.alloc(3)  # uncommitted slots too
    ready.set()
    time.sleep(60)


def test_client_killed_releases_leases(daemon):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_hold_and_die, args=(daemon.socket, 9, ready))
    p.start()
    assert ready.wait(60)
    assert daemon.stats()["leases"] == 4
    used_before = daemon.stats()["tiers"]["host"]["used_bytes"]
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    with daemon.client() as watcher:  # one steady connection: it counts itself as the only client
        deadline = time.time() + 10
        while time.time() < deadline and (watcher.stats()["leases"] or watcher.stats()["clients"] > 1):
            time.sleep(0.05)
        st = watcher.stats()
    assert st["leases"] == 0 and st["clients"] == 1
    assert st["tiers"]["host"]["used_bytes"] == used_before - 3 * 8192  # the 3 uncommitted slots came back


def test_disk_corruption_is_a_miss(daemon):
    import lmdb

    with daemon.client() as c:
        keys = keys_for(c, 4, seed=10)
        c.put(keys, rand_blocks(4, seed=10), durable=True)
    daemon.stop()
    env = lmdb.open(os.path.join(daemon.data_dir, "disk"), subdir=True)
    with env.begin(write=True) as txn:
        fk = list(txn.cursor().iternext(values=False))
        target = [k for k in fk if k.endswith(keys[2])][0]
        v = bytearray(txn.get(target))
        v[len(v) // 2] ^= 0x40  # flip a bit in the payload
        txn.put(target, bytes(v))
    env.close()
    daemon.start()
    with daemon.client() as c:
        with c.acquire(keys) as lease:
            assert lease.count == 2  # the reply names exactly the prefix that loaded
        with pytest.raises(KeyMissing):
            c.get(keys)
        st = c.stats()
        assert st["tiers"]["disk"]["corrupt"] >= 1
        assert c.lookup(keys) == 2  # the bad entry was dropped
        assert torch.equal(c.get(keys[:2]).view(torch.int16), rand_blocks(4, seed=10)[:2].view(torch.int16))


def test_map_full_no_crash(daemon_factory):
    big = tierkv.Layout(4, 4, 64, 16, "bfloat16")
    d = daemon_factory(["--host-capacity", "8MiB", "--slab-bytes", "1MiB", "--disk-capacity", "2MiB",
                        "--codec", "raw"], env={"TIERKV_DISK_ADMISSION": "all"})
    with d.client(layout=big) as c:
        keys = keys_for(c, 120, seed=11)
        blocks = rand_blocks(120, big, seed=11)
        for i in range(0, 120, 10):
            try:
                c.put(keys[i:i + 10], blocks[i:i + 10], durable=(i % 20 == 0))
            except TierKVError:
                pass  # a full tier is an error reply, never a crash
        assert c.ping()["pong"]
        st = c.stats()
        assert st["tiers"]["disk"]["used_bytes"] <= st["tiers"]["disk"]["capacity_bytes"]
        n = c.lookup(keys[-10:])
        assert n == 10
    assert d.proc.poll() is None


def test_wrong_shape_dtype_and_bad_keys(daemon):
    with daemon.client() as c:
        keys = keys_for(c, 2, seed=12)
        with pytest.raises(BadRequest, match="shape"):
            c.put(keys, torch.zeros(2, 2, 2, 2, 16, 31, dtype=torch.bfloat16))
        with pytest.raises(BadRequest, match="dtype"):
            c.put(keys, torch.zeros(SMALL.batch_shape(2), dtype=torch.float32))
        with pytest.raises(BadRequest):
            c.put([b""], rand_blocks(1))
        with pytest.raises(BadRequest):
            c.put([keys[0], keys[0]], rand_blocks(2))
        with pytest.raises(KeyMissing):
            c.get(keys)
        with pytest.raises(BadRequest, match="exceed"):
            c.alloc(10**7)
        assert c.put(keys, rand_blocks(2)) == 2  # the connection is still healthy
        assert c.lookup(keys) == 2


def _raw_conn(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    return s


def test_malformed_and_oversize_frames(daemon):
    with daemon.client() as c:
        keys = keys_for(c, 2, seed=13)
        c.put(keys, rand_blocks(2, seed=13))
    cases = [
        b"XX" + b"\x00" * 14,                                                    # bad magic
        struct.pack("<2sBBHHII", b"TK", 9, 0, 1, 0, 1, 0),                      # unknown version
        struct.pack("<2sBBHHII", b"TK", 1, 0, 1, 0, 1, 0xFFFFFFF0),             # 4 GiB claimed
        struct.pack("<2sBBHHII", b"TK", 1, 0, 1, 0, 1, 100) + b"\x01" * 10,     # truncated body
        protocol.HEADER.pack(b"TK", 1, 0, 1, 0, 1, 5) + b"\xc1\xc1\xc1\xc1\xc1",  # garbage msgpack
    ]
    for frame in cases:
        s = _raw_conn(daemon.socket)
        s.sendall(frame)
        s.shutdown(socket.SHUT_WR)
        data = s.recv(4096)  # an error reply or a closed connection, never a hang
        if data:
            op, status, rid, length = protocol.parse_header(data[:16], 1 << 20)
            assert status == protocol.STATUS_ERROR
        s.close()
    # unknown opcode and pickle payload get error replies on a live connection
    import pickle

    s = _raw_conn(daemon.socket)
    s.sendall(protocol.pack(999, 7, {}))
    op, status, rid, body = protocol.recv_frame(s)
    assert status == protocol.STATUS_ERROR and "opcode" in body["message"] and rid == 7
    payload = pickle.dumps({"x": 1})
    s.sendall(protocol.HEADER.pack(b"TK", 1, 0, int(protocol.Op.PING), 0, 8, len(payload)) + payload)
    op, status, rid, body = protocol.recv_frame(s)
    assert status == protocol.STATUS_ERROR
    s.close()
    with daemon.client() as c:  # the daemon and the data are fine
        assert torch.equal(c.get(keys).view(torch.int16), rand_blocks(2, seed=13).view(torch.int16))


def test_lease_misuse(daemon):
    with daemon.client() as a, daemon.client() as b:
        keys = keys_for(a, 2, seed=14)
        a.put(keys, rand_blocks(2))
        lease = a.acquire(keys)
        with pytest.raises(BadRequest):
            b._call(protocol.Op.RELEASE, {"leases": [lease.id]})  # another client's lease
        lease.release()
        with pytest.raises(BadRequest):
            a._call(protocol.Op.RELEASE, {"leases": [lease.id]})  # double release
        with pytest.raises(BadRequest):
            a._call(protocol.Op.COMMIT, {"keys": keys, "slots": [0, 8192]})  # slots not ours
        assert a.stats()["leases"] == 0


def test_socket_and_data_dir_permissions(daemon):
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(daemon.socket)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(daemon.data_dir).st_mode) == 0o700
    for f in os.listdir(os.path.join(daemon.data_dir, "disk")):
        assert stat.S_IMODE(os.stat(os.path.join(daemon.data_dir, "disk", f)).st_mode) & 0o077 == 0


def test_refuses_symlinked_or_open_data_dir(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    for bad in (link, open_dir):
        r = subprocess.run([sys.executable, "-m", "tierkv", "serve", "--socket", str(tmp_path / "s"),
                            "--data-dir", str(bad), "--host-capacity", "16MiB", "--slab-bytes", "1MiB"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0
        assert "Traceback" not in r.stderr and ("symlink" in r.stderr or "writable" in r.stderr)


def test_sigterm_drains_and_exits_zero(daemon):
    with daemon.client() as c:
        keys = keys_for(c, 10, seed=15)
        c.put(keys, rand_blocks(10, seed=15))
    assert daemon.stop(signal.SIGTERM) == 0
    assert not os.path.exists(daemon.socket)
    daemon.start()
    with daemon.client() as c:
        assert c.lookup_tiers(keys) == ["disk"] * 10


def test_peer_uid_refused(daemon):
    if os.getuid() != 0:
        pytest.skip("needs root to connect as another uid")
    r = subprocess.run([sys.executable, "-c", (
        "import os, socket, struct, sys\n"
        "os.setgid(65534); os.setuid(65534)\n"
        f"s = socket.socket(socket.AF_UNIX); s.connect({daemon.socket!r})\n"
        "s.sendall(struct.pack('<2sBBHHII', b'TK', 1, 0, 1, 0, 1, 1) + b'\\x80')\n"
        "print(len(s.recv(100)))\n")], capture_output=True, text=True, timeout=30)
    # nobody cannot even open a 0600 socket in a 0700 dir; SO_PEERCRED is the second line of defence
    assert r.returncode != 0 or r.stdout.strip() == "0"


def test_protocol_rejects_before_allocating():
    with pytest.raises(ProtocolError, match="cap"):
        protocol.parse_header(struct.pack("<2sBBHHII", b"TK", 1, 0, 1, 0, 1, 1 << 30), 1 << 20)


class _YieldingCounters(Server):
    """A server whose request counters yield the GIL between read and write (as a slow machine may), so
    an unguarded read-modify-write from two connection threads loses updates."""

    @property
    def _inflight(self) -> int:
        v = self.__dict__.get("_inflight_v", 0)
        time.sleep(0.0001)
        return v

    @_inflight.setter
    def _inflight(self, v: int) -> None:
        self.__dict__["_inflight_v"] = v

    @property
    def requests(self) -> int:
        v = self.__dict__.get("_requests_v", 0)
        time.sleep(0.0001)
        return v

    @requests.setter
    def requests(self, v: int) -> None:
        self.__dict__["_requests_v"] = v


def test_request_counters_stay_exact_under_many_connections(tmp_path):
    sockdir = tmp_path / "run"
    sockdir.mkdir(mode=0o700)
    cfg = load_config(env={}, overrides={"server.socket": str(sockdir / "s"), "server.data_dir": str(tmp_path / "d"),
                                         "host.capacity": "4MiB", "host.slab_bytes": "1MiB", "host.prefault": False,
                                         "disk.enabled": False, "server.drain_timeout_s": 1,
                                         "server.sample_interval_s": 0})
    srv = _YieldingCounters(cfg)
    srv.startup()
    loop = threading.Thread(target=srv._accept_loop, daemon=True)
    loop.start()
    conns, per_conn = 16, 40

    def hammer() -> None:
        c = RawClient(str(sockdir / "s"))
        try:
            for _ in range(per_conn):
                c.ok(Op.PING)
        finally:
            c.close()

    try:
        workers = [threading.Thread(target=hammer) for _ in range(conns)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        wait_for(lambda: srv._inflight == 0, 3.0)  # the last replies go out just before the count drops
        assert srv.requests == conns * per_conn
        assert srv._inflight == 0
    finally:
        srv.request_stop()
        loop.join(5)
        srv.shutdown()


def test_the_daemon_sets_its_allocator_tunables_itself(daemon_factory):
    """Started without them (the tests set them up front), ``tierkv serve`` re-executes itself once with
    glibc's allocator tunables in its environment."""
    d = daemon_factory(env={"GLIBC_TUNABLES": ""})
    assert d.proc is not None
    environ = open(f"/proc/{d.proc.pid}/environ", "rb").read().split(b"\0")
    assert any(e.startswith(b"GLIBC_TUNABLES=") and b"glibc.malloc.mmap_threshold" in e for e in environ)
    with d.client() as c:
        assert c.ping()["pong"]

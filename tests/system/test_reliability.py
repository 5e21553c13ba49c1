"""Reliability against real daemon processes: durability across kill -9, holds of dead clients, leaks
under churn, full disks and maps, I/O errors, corrupt values, namespace changes across restarts and a
graceful shutdown under load. The promises these check are listed in the README (Reliability); the
long versions are tools/crashloop.py (50 kill -9 loops) and tools/soak.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch
from click.testing import CliRunner

import tierkv
from tests.helpers import FAST_ENV, SMALL, RawClient, block_values, quiet_sample, shm_held_by, wait_for
from tierkv.client.admin import request
from tierkv.codecs import CodecError, decode_block, encode_block
from tierkv.codecs.container import _FIXED, _HASH, FORMAT_VERSION, MAGIC
from tierkv.core.errors import KeyMissing, TierKVError
from tierkv.core.keys import Namespace
from tierkv.core.layout import Layout
from tierkv.core.protocol import Op
from tierkv.ops import admin_cli

BIG = Layout(4, 4, 64, 16, "bfloat16")  # 64 KiB blocks: fills disks and maps quickly
KILL_LOOPS = 20


def rand_keys(tag: str, n: int) -> list[bytes]:
    """Engine-style opaque keys (the same bytes in every namespace)."""
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def same(t: torch.Tensor, keys: list[bytes], layout: Layout = SMALL) -> bool:
    return np.array_equal(t.view(torch.int16).numpy().view(np.uint16), block_values(keys, layout))


def missing_of(c: tierkv.Client, keys: list[bytes], layout: Layout = SMALL, chunk: int = 128) -> list[bytes]:
    """Keys that are absent or whose bytes differ from the oracle."""
    bad: list[bytes] = []
    for i in range(0, len(keys), chunk):
        part = keys[i:i + chunk]
        try:
            got = c.get(part)
        except KeyMissing:
            bad += [k for k in part if c.lookup([k]) == 0 or not same(c.get([k]), [k], layout)]
            continue
        if not same(got, part, layout):
            bad += [k for j, k in enumerate(part) if not same(got[j:j + 1], [k], layout)]
    return bad


def shm_entries() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.lower().startswith("tierkv")}


def disk_dir(d) -> str:
    return os.path.join(d.data_dir, "disk")


# ---- 1. durable acknowledgement survives kill -9 ----------------------------------------------------
def _durable_writer(sock: str, tag: str, acked: list, attempted: set, lock: threading.Lock,
                    stop: threading.Event) -> None:
    try:
        c = tierkv.Client.connect(sock, model="crash", layout=SMALL)
    except TierKVError:
        return  # the daemon died before we got in
    rng = random.Random(tag)
    try:
        for j in range(10**6):
            if stop.is_set():
                return
            keys = rand_keys(f"{tag}/{j}", rng.randint(1, 8))
            with lock:
                attempted.update(keys)
            c.put(keys, block_values(keys), durable=True)
            with lock:
                acked.extend(keys)
    except TierKVError:
        pass  # the connection died with the daemon: whatever was not acknowledged may be lost
    finally:
        c.close()


def _litter(d) -> set[str]:
    """Every name a killed daemon could leave behind besides shared memory (checked by name and by what it
    held): its socket's directory and its data directory."""
    data = {str(p.relative_to(d.data_dir)) for p in Path(d.data_dir).rglob("*")}
    return {f"sock:{n}" for n in os.listdir(d.sockdir)} | data


def test_kill9_loop_durable_acks_survive(daemon_factory):
    """4 clients write durably; the daemon is SIGKILLed at a random moment, 20 times in a row, and started
    again on the socket file it left. Every acknowledged block reads back bit-exact; an unacknowledged
    one is absent or whole; a scrub finds nothing bad; no shared memory, socket or data file builds up (the
    daemon holds no named shared memory when it is killed and no tierkv entry appears in /dev/shm)."""
    d = daemon_factory(env=FAST_ENV)
    rng = random.Random(2024)
    acked: list[bytes] = []
    attempted: set[bytes] = set()
    lock = threading.Lock()
    shm_before = shm_entries()
    litter: set[str] | None = None
    readers0 = d.stats()["tiers"]["disk"]["readers"]
    unacked_present = 0
    for loop in range(KILL_LOOPS):
        stop = threading.Event()
        start = len(acked)
        writers = [threading.Thread(target=_durable_writer, args=(d.socket, f"{loop}/{w}", acked, attempted, lock, stop))
                   for w in range(4)]
        for t in writers:
            t.start()
        time.sleep(rng.uniform(0.1, 0.5))
        assert shm_held_by(d.proc.pid) == set(), "the daemon holds named shared memory a kill would leave"
        d.kill(unlink=False)
        stop.set()
        for t in writers:
            t.join(30)
        d.start()  # over the socket file the killed daemon left
        if litter is None:
            litter = _litter(d)  # after the first crash: the data files the daemon keeps, and one socket
        assert _litter(d) <= litter, f"loop {loop}: left behind {sorted(_litter(d) - litter)}"
        with d.client(model="crash") as c:
            new = acked[start:]
            old = rng.sample(acked[:start], min(64, start))
            lost = missing_of(c, new + old)
            assert lost == [], f"loop {loop}: {len(lost)} acknowledged blocks lost or wrong"
            pending = sorted(attempted - set(acked))
            for k in rng.sample(pending, min(16, len(pending))):
                if c.lookup([k]):
                    unacked_present += 1
                    assert same(c.get([k]), [k]), "an unacknowledged block came back partial"
        assert d.stats()["tiers"]["disk"]["readers"] <= readers0  # the dead daemon's reader slots are gone
        assert shm_entries() <= shm_before
    assert len(acked) >= KILL_LOOPS, "the writers barely wrote anything: the loop tested nothing"
    with d.client(model="crash") as c:
        assert missing_of(c, acked) == []
    scrub = request(d.socket, "VERIFY", {"drop": False})
    assert scrub["bad"] == [] and scrub["checked"] >= len(set(acked))
    print(f"kill -9 loop: {KILL_LOOPS} loops, {len(acked)} durable acks, 0 lost, "
          f"{unacked_present} unacknowledged blocks found whole")


def test_durable_put_of_already_cached_keys_survives_kill9(daemon_factory):
    d = daemon_factory(env=FAST_ENV)
    keys = rand_keys("dedup", 4)
    with d.client() as a, d.client() as b:
        a.put(keys, block_values(keys))  # host tier only
        b.put(keys, block_values(keys), durable=True)  # acknowledged as durable
    d.kill()
    d.start()
    with d.client() as c:
        assert c.lookup(keys) == 4


# ---- 4/5. dead clients: leases released, nothing leaks ------------------------------------------------
# A client process with nothing but the standard library and msgpack: it maps the pool, leases blocks,
# holds uncommitted slots, says "ready" and waits to be SIGKILLed.
HOLDER = r"""
import json, mmap, socket, struct, sys, time
import msgpack
H = struct.Struct("<2sBBHHII")
path, ns, keys = sys.argv[1], json.loads(sys.argv[2]), [bytes.fromhex(k) for k in sys.argv[3].split(",")]
s = socket.socket(socket.AF_UNIX)
s.connect(path)
def call(op, rid, body):
    p = msgpack.packb(body, use_bin_type=True)
    s.sendall(H.pack(b"TK", 1, 0, op, 0, rid, len(p)) + p)
    head, fds = b"", []
    while len(head) < 16:
        data, got, _f, _a = socket.recv_fds(s, 16 - len(head), 4)
        if not data:
            sys.exit(3)
        head, fds = head + data, fds + got
    n, body = H.unpack(head)[6], b""
    while len(body) < n:
        body += s.recv(n - len(body))
    assert H.unpack(head)[4] == 0, body
    return msgpack.unpackb(body, raw=False), fds
r, fds = call(2, 1, {"namespace": ns})
pool = mmap.mmap(fds[0], r["pool_bytes"])
call(7, 2, {"keys": keys})
call(7, 3, {"keys": keys[:2]})
call(3, 4, {"n": 3})
print("ready", flush=True)
time.sleep(120)
"""


def _churn_cycle(path: str, ns: Namespace, keys: list[bytes], rng: random.Random) -> None:
    """Connect, take the pool, lease a prefix (sometimes twice, sometimes with open slots), then vanish."""
    c = RawClient(path)
    try:
        c.hello(ns, keep_fd=True)
        c.ok(Op.ACQUIRE, {"keys": keys[:rng.randint(1, len(keys))]})
        if rng.random() < 0.5:
            c.ok(Op.ACQUIRE, {"keys": keys[:rng.randint(1, len(keys))]})
        if rng.random() < 0.3:
            c.ok(Op.ALLOC, {"n": rng.randint(1, 4)})
    finally:
        c.close()  # no RELEASE, no ABORT: to the daemon this is a client that died


def _churn(path: str, ns: Namespace, keys: list[bytes], cycles: int, threads: int = 4) -> None:
    def run(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(cycles // threads):
            _churn_cycle(path, ns, keys, rng)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)


def test_dead_clients_release_everything_1000_cycles(daemon_factory):
    """1,000 connect / map / lease / vanish cycles plus SIGKILLed client processes that held leases,
    mappings and slots: leases, fds, mappings, threads, host usage and LMDB readers return to baseline,
    lease counts never go negative and every block is evictable again."""
    d = daemon_factory(env=FAST_ENV)
    ns = Namespace("test-model", SMALL)
    keys = rand_keys("churn", 32)
    with d.client() as c:
        c.put(keys, block_values(keys), durable=True)
    pid = d.proc.pid
    _churn(d.socket, ns, keys, 100)  # warm-up: thread stacks and malloc arenas exist from here on
    assert wait_for(lambda: d.stats()["leases"] == 0 and d.stats()["clients"] == 1)
    st0 = d.stats()
    base = quiet_sample(pid)

    _churn(d.socket, ns, keys, 1000)
    holders = []
    for _ in range(4):
        p = subprocess.Popen([sys.executable, "-c", HOLDER, d.socket, json.dumps(ns.to_dict()),
                              ",".join(k.hex() for k in keys[:8])], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        holders.append(p)
    held = d.stats()
    assert held["leases"] == 4 * (8 + 2) and held["tiers"]["host"]["used_bytes"] > st0["tiers"]["host"]["used_bytes"]
    for p in holders:
        p.send_signal(signal.SIGKILL)
        p.wait()

    assert wait_for(lambda: d.stats()["leases"] == 0 and d.stats()["clients"] == 1), "leases of dead clients stuck"
    st = d.stats()
    after = quiet_sample(pid)
    assert after["fds"] == base["fds"], (base, after)
    assert after["threads"] == base["threads"], (base, after)
    assert after["maps"] <= base["maps"] + 8, (base, after)  # glibc may keep a few thread stacks cached
    assert st["tiers"]["host"]["used_bytes"] == st0["tiers"]["host"]["used_bytes"]  # open slots came back
    assert st["tiers"]["disk"]["readers"] <= st0["tiers"]["disk"]["readers"]
    with d.client() as c:  # nothing is still pinned: every block can go
        assert c.delete(keys) == len(keys)
    d.stop()
    log = d.log.read_text()
    assert "Exception in thread" not in log and "AssertionError" not in log
    print(f"churn: fds {base['fds']}->{after['fds']}, maps {base['maps']}->{after['maps']}, "
          f"threads {base['threads']}->{after['threads']}, anon {base['anon_kb']}->{after['anon_kb']} kB")


_ALLOC_CHURN = r"""
import random, sys, threading
from tierkv.daemon.malloc import malloc_trim

def anon_kb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

def churn(seed):  # like connection threads: malloc-sized objects (1-64 KiB) come and go, a few live on
    rng, keep = random.Random(seed), []
    for _ in range(20_000):
        b = bytearray(rng.randint(1024, 65536))
        if rng.random() < 0.02:
            keep.append(b)
        if len(keep) > 100:
            keep.pop(rng.randrange(len(keep)))

base = anon_kb()
ts = [threading.Thread(target=churn, args=(i,)) for i in range(8)]
for t in ts:
    t.start()
for t in ts:
    t.join()
held = anon_kb()
assert malloc_trim()
print(base, held, anon_kb())
"""


def test_daemon_allocator_gives_freed_memory_back():
    """Under the daemon's glibc tunables (a high trim threshold keeps LMDB's value buffers warm), memory
    that eight threads malloc'd and freed comes back to the kernel with ``malloc_trim``, which the
    daemon calls every ``MALLOC_TRIM_S`` seconds: one arena (``arena_max=1``), whose top and holes
    malloc_trim releases; a thread arena's top it cannot release, and with 8 x cores arenas that
    retention grew the soak's RSS (docs/design.md, Daemon lifecycle and memory)."""
    from tierkv.daemon.malloc import MALLOC_TRIM_S, TUNABLES

    assert "glibc.malloc.arena_max=1" in TUNABLES and 0 < MALLOC_TRIM_S <= 30
    out = subprocess.run([sys.executable, "-c", _ALLOC_CHURN], env=dict(os.environ, GLIBC_TUNABLES=TUNABLES),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    base, held, trimmed = map(int, out.stdout.split())
    assert trimmed - base < 5 * 1024, f"anon kB: {base} at start, {held} after churn, {trimmed} after trim"


# ---- 3. full disk and full map ------------------------------------------------------------------------
@pytest.fixture
def small_fs(tmp_path: Path):
    """A 64 MiB tmpfs (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(c: tierkv.Client, tag: str, batches: int, per: int = 8) -> tuple[list[bytes], TierKVError | None]:
    """Durable puts of fresh 64 KiB blocks until one fails; returns the acknowledged keys and the error."""
    acked: list[bytes] = []
    for i in range(batches):
        keys = rand_keys(f"{tag}/{i}", per)
        try:
            c.put(keys, block_values(keys, BIG), durable=True)
        except TierKVError as exc:
            return acked, exc
        acked += keys
    return acked, None


def test_enospc_is_an_error_reads_go_on_and_writes_resume(small_fs, daemon_factory):
    ballast = small_fs / "ballast"
    with open(ballast, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 36 << 20)  # 28 MiB of the 64 MiB left: less than the tier's 32
    d = daemon_factory(["--disk-capacity", "32MiB", "--codec", "raw"], start=False, env=FAST_ENV)
    d.data_dir = str(small_fs / "data")
    d.start()
    with d.client(layout=BIG) as c:
        acked, err = _fill(c, "enospc", 80)
        assert acked, "nothing was written before the file system filled"
        assert err is not None and err.code == "full", err
        assert c.ping()["pong"] and d.proc.poll() is None
        assert missing_of(c, acked, BIG) == []  # reads go on
        assert c.stats()["tiers"]["disk"]["errors"] >= 1  # the failure is counted, not silent
        ballast.unlink()
        more, err = _fill(c, "enospc-after", 4)
        assert err is None and len(more) == 32, f"writes did not resume once space was freed: {err}"
    d.stop()
    d.start()
    with d.client(layout=BIG) as c:
        assert c.lookup(more) == len(more)


def test_disk_tier_larger_than_its_file_system_still_stores(small_fs, daemon_factory):
    d = daemon_factory(["--codec", "raw"], start=False, env=FAST_ENV)  # 1 GiB tier on a 64 MiB file system
    d.data_dir = str(small_fs / "data")
    d.start()
    with d.client(layout=BIG) as c:
        acked, err = _fill(c, "big-tier", 2)
        assert err is None, err


def _fill_map_under_a_reader(d, c: tierkv.Client) -> tuple[list[bytes], TierKVError | None]:
    """Hold an LMDB read transaction (pages freed after it cannot be reused) and write until the map fills."""
    env = lmdb.open(disk_dir(d), readonly=True, lock=True, subdir=True, max_readers=256)
    txn = env.begin()
    try:
        return _fill(c, "map", 400, per=4)
    finally:
        txn.abort()
        env.close()


MAP_ARGS = ["--disk-capacity", "2MiB", "--codec", "raw", "--host-capacity", "128MiB", "--slab-bytes", "1MiB"]


def test_map_full_is_an_error_reads_go_on_and_writes_resume(daemon_factory):
    """A 2 MiB tier has a ~66 MiB map; a reader pinning old pages makes 66 MiB of writes fill it."""
    d = daemon_factory(MAP_ARGS, env=FAST_ENV)
    with d.client(layout=BIG) as c:
        env = lmdb.open(disk_dir(d), readonly=True, lock=True, subdir=True, max_readers=256)
        txn = env.begin()
        acked, err = _fill(c, "map", 400, per=4)
        assert err is not None and err.code == "full" and "map" in str(err), err
        assert c.ping()["pong"] and d.proc.poll() is None
        assert missing_of(c, acked[-8:], BIG) == []  # reads go on while the map is full
        txn.abort()
        env.close()
        more, err = _fill(c, "map-after", 4, per=4)
        assert err is None, f"writes did not resume once the reader let go: {err}"
        assert c.health()["status"] == "ok"  # full is an error, not a failing disk
    assert d.proc.poll() is None


def _assert_lmdb_holds(d, blocks: int) -> None:
    """Kill the daemon and check that its LMDB holds exactly the ``blocks`` its table counted."""
    d.kill()
    env = lmdb.open(disk_dir(d), readonly=True, subdir=True)
    try:
        assert env.stat()["entries"] == blocks
    finally:
        env.close()


def test_failed_disk_write_keeps_the_table_and_lmdb_in_step(daemon_factory):
    d = daemon_factory(MAP_ARGS, env=FAST_ENV)
    with d.client(layout=BIG) as c:
        _acked, err = _fill_map_under_a_reader(d, c)
        assert err is not None
        _fill(c, "map-after", 2, per=4)
        blocks = c.stats()["tiers"]["disk"]["blocks"]
    _assert_lmdb_holds(d, blocks)


def test_a_job_failing_after_its_first_transaction_keeps_the_table_and_lmdb_in_step(daemon_factory):
    """Transactions of 2 blocks and every other disk write failing: a durable put of 8 blocks fails part
    way, after some of its transactions committed. Those blocks are on disk and the table counts them."""
    d = daemon_factory(["--codec", "raw"], env=dict(FAST_ENV, TIERKV_DISK_WRITE_BATCH="2",
                                                    TIERKV_FAULTS="write:EIO:0.5"))
    failed = 0
    with d.client(layout=BIG) as c:
        for i in range(12):
            _acked, err = _fill(c, f"part/{i}", 1, per=8)
            failed += err is not None
        blocks = c.stats()["tiers"]["disk"]["blocks"]
    assert failed and blocks  # both happened
    _assert_lmdb_holds(d, blocks)


# ---- EIO through the fault shim -----------------------------------------------------------------------
def test_eio_is_a_miss_or_an_error_and_health_degraded(daemon_factory):
    d = daemon_factory(env=FAST_ENV)
    keys = rand_keys("eio", 32)
    with d.client() as c:
        c.put(keys, block_values(keys), durable=True)
    d.stop()

    d.env["TIERKV_FAULTS"] = "read:EIO:0.3"
    d.start()
    with d.client() as c:
        assert c.health()["status"] == "ok"
        with c.acquire(keys) as lease:
            assert lease.count < len(keys)  # 0.7^32: some read failed
            for i in range(lease.count):  # the reply names exactly what loaded, and it is right
                assert same(lease.views[i][None], [keys[i]])
        with pytest.raises(KeyMissing):
            c.get(keys)
        h = c.health()
        assert h["status"] == "degraded" and "EIO" in h["reason"]
        assert c.stats()["tiers"]["disk"]["errors"] >= 1
    d.stop()

    d.env["TIERKV_FAULTS"] = "write:EIO"
    d.start()
    fresh = rand_keys("eio-write", 4)
    with d.client() as c:
        with pytest.raises(TierKVError, match="I/O"):
            c.put(fresh, block_values(fresh), durable=True)  # never acknowledged
        assert c.health()["status"] == "degraded"
        assert missing_of(c, keys) == []  # reads still work, and every stored block is intact
    d.kill()

    del d.env["TIERKV_FAULTS"]
    d.start()
    with d.client() as c:
        assert c.lookup(fresh) == 0  # the failed write left nothing behind
        assert c.health()["status"] == "ok"
        assert missing_of(c, keys) == []


# ---- 2. bit rot: detected, dropped, counted -------------------------------------------------------------
TINY = Layout(1, 1, 32, 16, "bfloat16")  # 2 KiB: every bit of an encoded block can be flipped quickly


@pytest.mark.parametrize("codec", ["raw", "lossless", "int8"])
def test_every_bit_flip_and_truncation_is_caught(codec):
    """Flip each bit of an encoded block, cut it at every length, extend it, move it to another key or
    namespace: decoding raises CodecError or returns the original bytes, never anything else."""
    fp, key = Namespace("m", TINY).fingerprint, b"k" * 16
    normal = np.random.default_rng(1).standard_normal(TINY.block_bytes // 2).astype(np.float32)
    raw = (normal.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # finite bf16: lossy codecs apply
    blob = encode_block(raw, layout=TINY, fingerprint=fp, key=key, codec=codec)
    ref = np.asarray(decode_block(blob, layout=TINY, fingerprint=fp, key=key)).tobytes()
    wrong = benign = 0
    for bit in range(len(blob) * 8):
        b = bytearray(blob)
        b[bit >> 3] ^= 1 << (bit & 7)
        try:
            out = np.asarray(decode_block(bytes(b), layout=TINY, fingerprint=fp, key=key)).tobytes()
        except CodecError:
            continue
        if out == ref:
            benign += 1  # e.g. a zstd frame-header bit that does not change the decoded bytes
        else:
            wrong += 1
    assert wrong == 0, f"{wrong} single-bit flips decoded to wrong data"
    for n in range(len(blob)):
        with pytest.raises(CodecError):
            decode_block(blob[:n], layout=TINY, fingerprint=fp, key=key)
    for bad in (blob + b"\x00", blob + blob):
        with pytest.raises(CodecError):
            decode_block(bad, layout=TINY, fingerprint=fp, key=key)
    with pytest.raises(CodecError):
        decode_block(blob, layout=TINY, fingerprint=fp, key=b"x" * 16)
    with pytest.raises(CodecError):
        decode_block(blob, layout=TINY, fingerprint=Namespace("m2", TINY).fingerprint, key=key)
    print(f"{codec}: {len(blob) * 8} bit flips, 0 wrong, {benign} decoded to the original bytes")


def _rehash(header_and_payload: bytearray, header_len: int) -> None:
    import xxhash

    end = header_len - _HASH.size
    _HASH.pack_into(header_and_payload, end, xxhash.xxh3_64_intdigest(bytes(header_and_payload[:end])))


def test_corrupt_values_are_misses_dropped_and_counted(daemon_factory):
    """Values damaged off-API in every way we can think of: none is ever served; the start-up scan drops
    those with a bad header, a read or ``tierkv verify --drop`` the others; the counter rises."""
    from tierkv.codecs import read_header

    d = daemon_factory(env=FAST_ENV)
    keys = rand_keys("rot", 24)
    with d.client() as c:
        c.put(keys, block_values(keys), durable=True)
        fp = c.fingerprint
    d.stop()

    env = lmdb.open(disk_dir(d), subdir=True)
    with env.begin(write=True) as txn:
        def value(i: int) -> bytes:
            return bytes(txn.get(fp + keys[i]))

        hlen = read_header(value(0)).header_len
        flip_head = bytearray(value(3))
        flip_head[30] ^= 0x01
        future = bytearray(value(5))
        future[4] = FORMAT_VERSION + 1  # a later format, with a header hash that matches it
        _rehash(future, hlen)
        other_ns = encode_block(block_values([keys[7]]).view(np.uint8).reshape(-1), layout=SMALL,
                                fingerprint=Namespace("other", SMALL).fingerprint, key=keys[7])
        flip_payload = bytearray(value(13))
        flip_payload[hlen + 100] ^= 0x80
        scan_level = {  # caught by the header check at start-up (7: intact, of another namespace: "foreign")
            2: b"",
            3: bytes(flip_head),
            5: bytes(future),
            7: other_ns,
            9: value(9)[: len(value(9)) // 2],
            11: value(11) + b"\x00" * 100,
            15: b"cos\nsystem\n(S'true'\ntR.",  # a pickle
            17: MAGIC + b"\x00" * (_FIXED.size + 4),
        }
        payload_level = {  # header fine, payload or identity wrong: caught when read or scrubbed
            13: bytes(flip_payload),
            19: value(20),  # block 20's value under block 19's key
        }
        for i, v in {**scan_level, **payload_level}.items():
            txn.put(fp + keys[i], v)
    env.close()

    d.start()
    with d.client() as c:
        assert c.stats()["tiers"]["disk"]["corrupt"] == len(scan_level) - 1
        assert c.stats()["tiers"]["disk"]["foreign"] == 1
        runner = CliRunner()
        r = runner.invoke(admin_cli.verify, ["--json", "--socket", d.socket])
        assert r.exit_code == 1, r.output  # bad entries remain
        report = json.loads(r.output)
        assert {e["key"] for e in report["bad"]} == {(fp + keys[i]).hex() for i in payload_level}
        with c.acquire(keys) as lease:
            assert lease.count == 2  # stops at the first bad block
            assert all(same(lease.views[i][None], [keys[i]]) for i in range(2))
        with pytest.raises(KeyMissing):
            c.get([keys[13]])  # read: a miss, dropped, counted
        assert c.stats()["tiers"]["disk"]["corrupt"] == len(scan_level)
        # the record went at once; the value's delete commits just after the reply
        assert wait_for(lambda: len(request(d.socket, "VERIFY", {"drop": False})["bad"]) == 1, timeout=10)
        r = runner.invoke(admin_cli.verify, ["--drop", "--socket", d.socket])
        assert r.exit_code == 0 and "1 bad, 1 dropped" in r.output, r.output
        r = runner.invoke(admin_cli.verify, ["--socket", d.socket])
        assert r.exit_code == 0 and "0 bad" in r.output, r.output
        bad = set(scan_level) | set(payload_level)
        good = [k for i, k in enumerate(keys) if i not in bad]
        assert missing_of(c, good) == []
        assert all(c.lookup([keys[i]]) == 0 for i in bad)
        assert c.stats()["tiers"]["disk"]["blocks"] == len(good)


class _FakeDaemon:
    """A socket that answers VERIFY with a canned reply, or never answers (``reply=None``)."""

    def __init__(self, path: str, reply: dict | None) -> None:
        import socket as _s

        from tierkv.core import protocol

        self.path, self.reply = path, reply
        self.lst = _s.socket(_s.AF_UNIX, _s.SOCK_STREAM)
        self.lst.bind(path)
        self.lst.listen(4)
        self.conns: list = []

        def serve() -> None:
            while True:
                try:
                    conn, _ = self.lst.accept()
                except OSError:
                    return
                self.conns.append(conn)
                op, _status, rid, _body = protocol.recv_frame(conn)
                if self.reply is not None:
                    conn.sendall(protocol.pack(op, rid, self.reply))

        threading.Thread(target=serve, daemon=True).start()

    def close(self) -> None:
        self.lst.close()
        for c in self.conns:
            c.close()


def test_verify_caps_the_listed_bad_entries_and_has_a_timeout(tmp_path):
    """``tierkv verify`` lists at most ``--max-bad`` bad entries (the counts stay whole, the exit code
    too), and ``--timeout`` bounds the wait for a scrub that does not answer."""
    bad = [{"key": f"{i:064x}", "error": "checksum mismatch"} for i in range(250)]
    fake = _FakeDaemon(str(tmp_path / "v.sock"), {"checked": 1000, "bad": bad, "dropped": 0})
    runner = CliRunner()
    try:
        r = runner.invoke(admin_cli.verify, ["--socket", fake.path])
        assert r.exit_code == 1, r.output
        lines = r.output.splitlines()
        assert sum(ln.startswith("bad: ") for ln in lines) == admin_cli.VERIFY_MAX_BAD == 100
        assert "150 more bad entries not listed" in r.output
        assert lines[-1] == "checked 1000 blocks: 250 bad, 0 dropped"
        r = runner.invoke(admin_cli.verify, ["--socket", fake.path, "--max-bad", "0"])
        assert sum(ln.startswith("bad: ") for ln in r.output.splitlines()) == 250 and "more bad" not in r.output
        r = runner.invoke(admin_cli.verify, ["--socket", fake.path, "--json", "--max-bad", "7"])
        report = json.loads(r.output)
        assert r.exit_code == 1 and len(report["bad"]) == 7 and report["bad_count"] == report["remaining"] == 250
    finally:
        fake.close()
    silent = _FakeDaemon(str(tmp_path / "s.sock"), None)
    try:
        t0 = time.monotonic()
        r = runner.invoke(admin_cli.verify, ["--socket", silent.path, "--timeout", "0.5"])
        assert r.exit_code == 2 and "no reply" in r.output and "within 0.5 s" in r.output, r.output
        assert time.monotonic() - t0 < 5
    finally:
        silent.close()


# ---- namespace changes across restarts -----------------------------------------------------------------
def test_restart_with_another_namespace_never_serves_old_blocks(daemon_factory):
    d = daemon_factory(env=FAST_ENV)
    keys = rand_keys("ns", 8)  # engine-supplied keys: identical bytes whatever the namespace
    with d.client(model="m") as c:
        c.put(keys, block_values(keys), durable=True)
    d.kill()
    d.start()
    variants = {
        "model": Namespace("m2", SMALL),
        "dtype": Namespace("m", Layout(2, 2, 32, 16, "float16")),
        "block tokens": Namespace("m", Layout(2, 2, 32, 32, "bfloat16")),
        "heads x dim (same block size)": Namespace("m", Layout(2, 4, 16, 16, "bfloat16")),
        "layers": Namespace("m", Layout(4, 1, 32, 16, "bfloat16")),
        "tp rank": Namespace("m", SMALL, tp_rank=1, tp_size=2),
        "tp size": Namespace("m", SMALL, tp_rank=0, tp_size=2),
        "identity (same name, other weights)": Namespace("m", SMALL, identity="f" * 32),
    }
    rc = RawClient(d.socket)
    try:  # a client of the earlier namespace format is refused with a reason, not served
        status, reply = rc.hello({**Namespace("m", SMALL).to_dict(), "format_version": 1})
        assert status != 0 and "namespace format 1" in reply["message"], reply
    finally:
        rc.close()
    for name, ns in variants.items():
        rc = RawClient(d.socket)
        try:
            assert rc.hello(ns)[0] == 0, name
            assert rc.ok(Op.LOOKUP, {"keys": keys})["count"] == 0, name
            assert rc.ok(Op.ACQUIRE, {"keys": keys})["slots"] == [], name
            # its own blocks under the same keys never overwrite the first namespace's
            slots = rc.ok(Op.ALLOC, {"n": 2, "keys": keys[:2]})["slots"]
            assert None not in slots, name
            rc.ok(Op.COMMIT, {"keys": keys[:2], "slots": slots, "durable": True})
        finally:
            rc.close()
    d.stop()
    d.start()
    with d.client(model="m") as c:
        assert same(c.get(keys), keys)
    assert len(d.stats()["namespaces"]) >= 1


# ---- graceful shutdown under load ----------------------------------------------------------------------
def _busy_writer(sock: str, tag: str, acked: list, stop: threading.Event) -> None:
    c = tierkv.Client.connect(sock, model="term", layout=SMALL)
    try:
        for j in range(10**6):
            if stop.is_set():
                return
            keys = rand_keys(f"{tag}/{j}", 8)
            c.put(keys, block_values(keys))  # not durable: the shutdown flush makes them so
            acked.extend(keys)
            c.get(keys[:2])
    except TierKVError:
        pass
    finally:
        c.close()


def test_sigterm_under_load_drains_leaves_nothing_and_restarts_warm(daemon_factory):
    drain = 20.0
    d = daemon_factory(env={**FAST_ENV, "TIERKV_SERVER_DRAIN_TIMEOUT_S": str(drain)})
    shm_before = shm_entries()
    acked: list[bytes] = []
    stop = threading.Event()
    writers = [threading.Thread(target=_busy_writer, args=(d.socket, str(w), acked, stop)) for w in range(4)]
    for t in writers:
        t.start()
    assert wait_for(lambda: len(acked) >= 200, timeout=30)
    t0 = time.monotonic()
    rc = d.stop(signal.SIGTERM, timeout=drain + 30)
    took = time.monotonic() - t0
    stop.set()
    for t in writers:
        t.join(30)
    assert rc == 0, d.log.read_text()[-2000:]
    assert took < drain + 10, f"SIGTERM took {took:.1f}s (drain timeout {drain}s)"
    assert not os.path.exists(d.socket)
    assert shm_entries() <= shm_before
    assert admin_cli.lmdb_holders(Path(disk_dir(d))) == []
    d.start()
    with d.client(model="term") as c:
        tiers = c.lookup_tiers(acked)
        assert tiers == ["disk"] * len(acked), f"{tiers.count('disk')} of {len(acked)} acknowledged blocks warm"
        assert missing_of(c, random.Random(1).sample(acked, 64)) == []
    print(f"SIGTERM under load: exit 0 after {took:.2f}s, {len(acked)} blocks warm on restart")

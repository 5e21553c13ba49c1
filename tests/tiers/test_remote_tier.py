"""Remote tier against real redis-server processes: round trips (standalone, Unix socket, cluster, TLS,
Valkey), two nodes sharing one remote, outages and the circuit breaker, a full server, poisoned values,
ACL limits. Servers are started per test module on free loopback ports (tests/redis_servers.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import redis
import torch

import tierkv
from tests import redis_servers
from tests.redis_servers import (
    ACL_PASSWORD,
    ACL_RULE,
    ACL_USER,
    VALKEY_CLI,
    VALKEY_SERVER,
    RedisServer,
    make_tls_files,
    need_redis,
    need_valkey,
)
from tierkv.codecs import encode_block
from tierkv.core.errors import BadRequest
from tierkv.core.keys import Namespace
from tierkv.movers.remote import RemoteMover
from tierkv.tiers.remote import RemoteConfig, RemoteTier, remote_key

# The servers' fixtures, made visible to pytest in this module.
redis_server = redis_servers.redis_server
redis_factory = redis_servers.redis_factory
redis_cluster = redis_servers.redis_cluster

# 2 layers x 2 heads x 16 tokens x 32 dims, bf16: 8 KiB a block keeps the tests quick.
LAYOUT = tierkv.Layout(num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=16, dtype="bfloat16")
NS = Namespace("test-model", LAYOUT)
FP = NS.fingerprint
# Fast failure for the fault tests: short timeouts and backoff.
FAST = dict(socket_timeout_s=0.5, connect_timeout_s=0.5, backoff_s=0.1, max_backoff_s=0.4)


def blocks(n: int, seed: int = 0) -> np.ndarray:
    """``n`` raw blocks (uint8 rows of block_bytes) of bf16 normals."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(LAYOUT.batch_shape(n), generator=g).to(torch.bfloat16)
    return t.view(torch.uint8).numpy().reshape(n, LAYOUT.block_bytes).copy()


def keys(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}{i:06d}".encode() for i in range(n)]


def store(tier: RemoteTier, ks: list[bytes], raw: np.ndarray, codec: str = "lossless") -> list[bool]:
    mover = RemoteMover(tier)
    try:
        return mover.store([(FP, k, raw[i]) for i, k in enumerate(ks)], LAYOUT, codec=codec)
    finally:
        mover.close()


def fetch(tier: RemoteTier, ks: list[bytes]) -> tuple[list[bool], np.ndarray]:
    outs = np.zeros((len(ks), LAYOUT.block_bytes), np.uint8)
    ok = RemoteMover(tier).fetch([(FP, k) for k in ks], LAYOUT, list(outs))
    return ok, outs


def wait_state(tier: RemoteTier, want: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while tier.state()["state"] != want:
        assert time.monotonic() < deadline, tier.state()
        tier.ping()
        time.sleep(0.05)


# ---- no server needed ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(admission="sometimes"), dict(max_batch=0), dict(batch_bytes=0),
                                dict(max_value_bytes=0), dict(socket_timeout_s=0), dict(backoff_s=-1),
                                dict(ttl_s=-1), dict(key_prefix=b""), dict(key_prefix=b"{tag}:"),
                                dict(key_prefix="tierkv:")])
def test_bad_settings_raise(kw):
    with pytest.raises(ValueError):
        RemoteTier("redis://127.0.0.1:1/0", **kw)


def test_from_config():
    with pytest.raises(ValueError, match="empty"):
        RemoteTier.from_config(RemoteConfig())
    t = RemoteTier.from_config(RemoteConfig(url="redis://u:pw@127.0.0.1:1/0", ttl_s=5, codec="int8"))
    assert t.url == "redis://u:***@127.0.0.1:1/0" and t.ttl_ms == 5000 and t.codec == "int8"


def test_nothing_connects_until_used_and_a_dead_remote_is_a_miss():
    t = RemoteTier("redis://127.0.0.1:1/0", **FAST)  # port 1: refused
    assert t.state()["state"] == "up"
    assert t.get_many([(FP, b"a")]) == [None]
    st = t.stats()
    assert st["state"] == "down" and st["reason"] == "connection" and st["trips"] == 1 and st["misses"] == 1
    assert t.put_many([(FP, b"a", b"x")]) == [False]  # dropped without touching the network
    assert t.exists_many([(FP, b"a")]) == [False] and t.delete_many([(FP, b"a")]) == 0
    assert t.stats()["put_dropped"] == 1 and t.stats()["trips"] == 1


# ---- standalone -----------------------------------------------------------------------------------------


@need_redis
@pytest.mark.parametrize("codec", ["lossless", "raw", "int8"])
@pytest.mark.parametrize("fast_reads", [True, False])
def test_round_trip_bit_exact(redis_server, codec, fast_reads):
    tier = RemoteTier(redis_server.url, fast_reads=fast_reads, max_batch=5)
    raw = blocks(12, seed=1)
    ks = keys(12, f"rt-{codec}-{fast_reads}-")
    assert all(store(tier, ks, raw, codec))
    assert tier.exists_many([(FP, k) for k in ks + [b"absent"]]) == [True] * 12 + [False]
    assert tier.prefix_len(FP, ks[:4] + [b"absent"] + ks[4:]) == 4
    ok, outs = fetch(tier, ks)
    assert all(ok)
    if codec == "int8":  # lossy: the decoded block is what the codec gives back, not the original bytes
        from tierkv.codecs import decode_block

        for i, k in enumerate(ks):
            assert np.array_equal(outs[i], decode_block(encode_block(raw[i], layout=LAYOUT, fingerprint=FP, key=k,
                                                                     codec="int8"), layout=LAYOUT, fingerprint=FP, key=k))
    else:
        assert np.array_equal(outs, raw)
    vals = tier.get_many([(FP, k) for k in ks[:3]] + [(FP, b"absent")])
    assert vals[3] is None
    for i in range(3):
        assert bytes(vals[i]) == encode_block(raw[i], layout=LAYOUT, fingerprint=FP, key=ks[i], codec=codec)
    st = tier.stats()
    assert st["state"] == "up" and st["puts"] == 12 and st["hits"] == 15 and st["misses"] == 1
    assert st["corrupt"] == 0 and st["errors"] == 0 and st["bytes_in"] > 0 and st["bytes_out"] > 0
    assert st["round_trips"] >= 3  # 12 keys in batches of 5
    assert tier.delete_many([(FP, k) for k in ks]) == 12
    assert fetch(tier, ks[:2])[0] == [False, False]
    tier.close()


@need_redis
def test_unix_socket_and_ttl(redis_server):
    tier = RemoteTier(redis_server.unix_url, ttl_s=60)
    raw = blocks(3, seed=2)
    ks = keys(3, "unix-")
    assert all(store(tier, ks, raw))
    ok, outs = fetch(tier, ks)
    assert all(ok) and np.array_equal(outs, raw)
    pttl = redis_server.admin().pttl(remote_key(FP, ks[0]))
    assert 0 < pttl <= 60_000
    tier.close()


@need_redis
def test_two_nodes_share_one_remote(redis_server):
    """Two sidecars (separate tiers, separate pools): blocks stored through A are hits through B."""
    a = RemoteTier(redis_server.url)
    b = RemoteTier(redis_server.url)
    raw = blocks(20, seed=3)
    ks = keys(20, "shared-")
    assert b.prefix_len(FP, ks) == 0
    assert all(store(a, ks[:15], raw[:15]))
    assert b.prefix_len(FP, ks) == 15  # one round trip tells B how much of the prefix the fleet has
    ok, outs = fetch(b, ks)
    assert ok == [True] * 15 + [False] * 5
    assert np.array_equal(outs[:15], raw[:15])
    assert b.stats()["hits"] == 15 and b.stats()["misses"] == 5 and a.stats()["puts"] == 15
    # Another namespace never sees these blocks.
    other = Namespace("other-model", LAYOUT).fingerprint
    assert b.exists_many([(other, k) for k in ks[:3]]) == [False] * 3
    a.close()
    b.close()


@need_redis
def test_threads_share_one_tier(redis_server):
    """The engine calls one tier from several worker threads: each call uses its own connection."""
    from concurrent.futures import ThreadPoolExecutor

    tier = RemoteTier(redis_server.url, max_batch=3)
    raw = blocks(8, seed=12)

    def work(t: int) -> bool:
        ks = keys(8, f"thread{t}-")
        if not all(store(tier, ks, raw)):
            return False
        ok, outs = fetch(tier, ks)
        return all(ok) and np.array_equal(outs, raw) and tier.prefix_len(FP, ks) == 8

    with ThreadPoolExecutor(4) as ex:
        assert all(ex.map(work, range(8)))
    st = tier.stats()
    assert st["puts"] == 64 and st["hits"] == 64 and st["errors"] == 0
    tier.close()


@need_redis
def test_poisoned_values_are_misses(redis_server):
    tier = RemoteTier(redis_server.url)
    admin = redis_server.admin()
    raw = blocks(9, seed=4)
    ks = keys(9, "poison-")
    good = [encode_block(raw[i], layout=LAYOUT, fingerprint=FP, key=ks[i], codec="raw") for i in range(9)]
    flipped = bytearray(good[1])
    flipped[-100] ^= 0x01
    other_fp = Namespace("other-model", LAYOUT).fingerprint
    other_layout = tierkv.Layout(2, 2, 32, 16, "float16")
    poison = {
        1: bytes(flipped),                                                                  # wrong checksum
        2: encode_block(raw[2], layout=LAYOUT, fingerprint=other_fp, key=ks[2]),            # wrong namespace
        3: good[4],                                                                         # another key's value
        4: b"\x00garbage" * 100,                                                            # garbage
        5: good[5][:len(good[5]) // 2],                                                     # truncated
        6: b"",                                                                             # empty
        7: encode_block(raw[7], layout=other_layout, fingerprint=FP, key=ks[7]),            # another layout
    }
    for i, k in enumerate(ks):
        admin.set(remote_key(FP, k), poison.get(i, good[i]))
    big = remote_key(FP, b"huge")
    admin.set(big, b"\x00" * (LAYOUT.block_bytes * 2 + (128 << 10)))                      # oversized
    wrong_type = remote_key(FP, b"hash")
    admin.hset(wrong_type, "f", "v")                                                        # not a string
    all_keys = ks + [b"huge", b"hash"]
    ok, outs = fetch(tier, all_keys)
    assert ok == [True, False, False, False, False, False, False, False, True, False, False]
    assert np.array_equal(outs[0], raw[0]) and np.array_equal(outs[8], raw[8])
    st = tier.stats()
    # the other namespace's intact value is counted as foreign, the rest as corrupt: all misses
    assert st["state"] == "up" and st["corrupt"] == 7 and st["foreign"] == 1 and st["hits"] == 2
    assert st["misses"] == 9
    # Corrupt strings were deleted (the hash is not ours to delete by type, but UNLINK removes it too).
    assert admin.exists(*[remote_key(FP, ks[i]) for i in poison]) == 0 and admin.exists(big) == 0
    assert admin.exists(remote_key(FP, ks[0])) == 1
    tier.close()


@need_redis
def test_server_killed_mid_run_then_recovers(redis_factory):
    srv = redis_factory()
    tier = RemoteTier(srv.url, **FAST)
    raw = blocks(8, seed=5)
    ks = keys(8, "kill-")
    assert all(store(tier, ks[:4], raw[:4]))
    srv.kill()
    t0 = time.monotonic()
    ok, _ = fetch(tier, ks[:4])
    assert ok == [False] * 4 and time.monotonic() - t0 < 2.0
    assert store(tier, ks[4:], raw[4:]) == [False] * 4  # dropped, never raised
    st = tier.stats()
    assert st["state"] == "down" and st["reason"] == "connection" and st["put_dropped"] >= 4
    srv.start()  # same port, empty (no persistence)
    wait_state(tier, "up")
    assert tier.stats()["recoveries"] >= 1
    assert all(store(tier, ks, raw))
    ok, outs = fetch(tier, ks)
    assert all(ok) and np.array_equal(outs, raw)
    tier.close()


@need_redis
def test_hung_server_costs_at_most_the_timeout(redis_factory):
    srv = redis_factory()
    tier = RemoteTier(srv.url, **FAST)
    raw = blocks(4, seed=6)
    ks = keys(4, "hung-")
    assert all(store(tier, ks, raw))
    srv.pause()
    try:
        t0 = time.monotonic()
        ok, _ = fetch(tier, ks)
        took = time.monotonic() - t0
        assert ok == [False] * 4
        assert took < 0.5 * 2 + 1.0, took  # one receive timeout (plus slack for a loaded machine)
        assert tier.state()["state"] == "down" and tier.state()["reason"] == "timeout"
        t0 = time.monotonic()
        for _ in range(20):  # while the breaker is open nothing waits on the network
            assert fetch(tier, ks[:1])[0] == [False]
        assert time.monotonic() - t0 < 0.5
    finally:
        srv.resume()
    wait_state(tier, "up")
    ok, outs = fetch(tier, ks)
    assert all(ok) and np.array_equal(outs, raw)
    tier.close()


@need_redis
def test_full_server_under_noeviction(redis_factory):
    srv = redis_factory(maxmemory="4mb", policy="noeviction")
    tier = RemoteTier(srv.url, **FAST)
    raw = blocks(68, seed=7)
    ks = keys(68, "full-")
    assert all(store(tier, ks[:4], raw[:4]))
    admin = srv.admin()
    with pytest.raises(redis.exceptions.ResponseError):  # OOM
        for i in range(4000):  # fill the server until it refuses writes
            admin.set(f"filler-{i}", b"\x00" * (4 << 10))
    # The server checks memory before each command, so some values may still squeeze into its slack (how
    # many depends on its allocator's accounting: up to four 8 KiB blocks were seen); 64 more cannot all
    # fit, and those that do not are dropped, never raised.
    assert False in store(tier, ks[4:], raw[4:])
    assert store(tier, ks[4:8], raw[4:8]) == [False] * 4  # read-only: not even sent until the backoff passes
    st = tier.state()
    assert st["state"] == "read-only" and st["reason"] == "full" and "OOM" in st["last_error"], st
    assert tier.stats()["put_dropped"] >= 4
    ok, outs = fetch(tier, ks[:4])  # reads are still served
    assert all(ok) and np.array_equal(outs, raw[:4])
    admin.delete(*[f"filler-{i}" for i in range(4000)])
    wait_state_writes(tier)
    assert all(store(tier, ks[4:], raw[4:]))
    tier.close()


def wait_state_writes(tier: RemoteTier, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while tier.state()["state"] != "up":
        assert time.monotonic() < deadline, tier.state()
        tier.put_many([(FP, b"probe", b"\x00" * 16)])
        time.sleep(0.05)


@need_redis
def test_acl_user_limited_to_tierkv_keys(redis_factory):
    srv = redis_factory(users=[ACL_RULE, "reader on >r ~tierkv:* resetchannels -@all +get +exists +ping"])
    tier = RemoteTier(srv.url, username=ACL_USER, password=ACL_PASSWORD)
    raw = blocks(4, seed=8)
    ks = keys(4, "acl-")
    assert all(store(tier, ks, raw))
    ok, outs = fetch(tier, ks)
    assert all(ok) and np.array_equal(outs, raw) and tier.state()["state"] == "up"
    limited = redis.Redis(host="127.0.0.1", port=srv.port, username=ACL_USER, password=ACL_PASSWORD, protocol=2)
    for cmd in (("FLUSHALL",), ("KEYS", "*"), ("SET", "elsewhere", "x"), ("CONFIG", "GET", "maxmemory")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            limited.execute_command(*cmd)
    assert srv.admin().dbsize() == 4
    # A user that may only read: puts are dropped (read-only), reads still work.
    reader = RemoteTier(srv.url, username="reader", password="r", **FAST)
    assert store(reader, ks[:1], raw[:1]) == [False]
    assert reader.state()["state"] == "read-only" and reader.state()["reason"] == "denied"
    assert all(fetch(reader, ks)[0])
    # A wrong password: down, misses, no exception.
    wrong = RemoteTier(srv.url, username=ACL_USER, password="nope", **FAST)
    assert fetch(wrong, ks[:1])[0] == [False]
    assert wrong.state()["state"] == "down" and wrong.state()["reason"] == "auth"
    for t in (tier, reader, wrong):
        t.close()


@need_redis
def test_tls(redis_factory, tmp_path):
    files = make_tls_files(tmp_path / "tls")
    if files is None:
        pytest.skip("openssl could not make a test certificate")
    try:
        srv = redis_factory(tls=files)
    except RuntimeError as exc:
        pytest.skip(f"redis-server without TLS support: {exc}")
    tier = RemoteTier(srv.tls_url)
    raw = blocks(3, seed=9)
    ks = keys(3, "tls-")
    assert all(store(tier, ks, raw))
    ok, outs = fetch(tier, ks)
    assert all(ok) and np.array_equal(outs, raw)
    tier.close()


@need_redis
def test_caller_misuse_raises(redis_server):
    tier = RemoteTier(redis_server.url)
    with pytest.raises(BadRequest):
        RemoteMover(tier).fetch([(FP, b"a")], LAYOUT, [])
    with pytest.raises(BadRequest):
        tier.put_many([(b"short", b"a", b"x")])
    with pytest.raises(BadRequest):
        tier.put_many([(FP, b"a", 12345)])
    assert tier.state()["state"] == "up"


# ---- cluster ------------------------------------------------------------------------------------------


@need_redis
def test_cluster_round_trip_two_nodes(redis_cluster):
    a = RemoteTier(redis_cluster.url, max_batch=8)
    # One seed is enough; B is the ACL user limited to tierkv:* keys.
    b = RemoteTier("redis://127.0.0.1:%d" % redis_cluster.nodes[1].port, cluster=True, username=ACL_USER,
                   password=ACL_PASSWORD)
    raw = blocks(24, seed=10)
    ks = keys(24, "cluster-")
    assert all(store(a, ks, raw))
    per_node = [n.admin().dbsize() for n in redis_cluster.nodes]
    assert sum(per_node) == 24 and sum(1 for c in per_node if c) == 3  # spread over every primary: no hash tag
    assert b.prefix_len(FP, ks) == 24
    ok, outs = fetch(b, ks)
    assert all(ok) and np.array_equal(outs, raw)
    assert a.ping() and b.ping()
    info = b.server_info()
    assert info is not None and info["nodes"] == 3
    assert b.delete_many([(FP, k) for k in ks[:5]]) == 5
    assert fetch(a, ks[:6])[0] == [False] * 5 + [True]
    assert a.stats()["errors"] == 0 and b.stats()["errors"] == 0
    a.close()
    b.close()


# ---- valkey -------------------------------------------------------------------------------------------


@need_valkey
def test_valkey_round_trip(tmp_path):
    srv = RedisServer(binary=VALKEY_SERVER, cli=VALKEY_CLI).start()
    try:
        a, b = RemoteTier(srv.url), RemoteTier(srv.url)
        raw = blocks(6, seed=11)
        ks = keys(6, "valkey-")
        assert all(store(a, ks, raw))
        ok, outs = fetch(b, ks)
        assert all(ok) and np.array_equal(outs, raw)
    finally:
        srv.stop()

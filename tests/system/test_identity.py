"""Cache identity inside real daemons: a block is served only to the namespace (model identity, layout,
TP rank) it was computed for. Two engines of the same model name but other weights never share a block;
a value of another identity found under a key, on disk or in Redis, is a miss, counted and dropped;
blocks an earlier tierkv wrote are dropped at start, and ``tierkv doctor`` says so."""

from __future__ import annotations

import json
import os
import time

import lmdb
import numpy as np
import torch
from click.testing import CliRunner

from tests import redis_servers
from tests.helpers import FAST_ENV, SMALL, as_earlier_format, block_values, wait_for
from tests.redis_servers import need_redis
from tierkv.codecs import encode_block
from tierkv.core.errors import KeyMissing
from tierkv.ops import admin_cli
from tierkv.tiers.remote.url import remote_key

redis_server = redis_servers.redis_server

V1, V2 = "1" * 32, "2" * 32  # two versions of the weights, both served as "model"


def _same(t: torch.Tensor, keys: list[bytes]) -> bool:
    return np.array_equal(t.view(torch.int16).numpy().view(np.uint16), block_values(keys))


def _keys(c, n: int, seed: int) -> list[bytes]:
    return c.block_keys(list(range(seed * 10_000, seed * 10_000 + n * SMALL.block_tokens)))


def _blob_of(c_other, keys: list[bytes], i: int) -> bytes:
    """What the other identity's engine would store for block ``i``: intact, under its own namespace."""
    raw = block_values([keys[i]]).view(np.uint8).reshape(-1)
    return encode_block(raw, layout=SMALL, fingerprint=c_other.fingerprint, key=keys[i], codec="raw")


def test_same_name_other_weights_share_nothing_and_same_weights_share_everything(daemon):
    with daemon.client(model="model", identity=V1) as v1, daemon.client(model="model", identity=V2) as v2, \
            daemon.client(model="renamed-copy", identity=V1) as copy:
        tokens = list(range(500, 500 + 6 * SMALL.block_tokens))
        k1 = v1.block_keys(tokens)
        v1.put(k1, block_values(k1))
        assert v2.lookup(v2.block_keys(tokens)) == 0  # same name, same tokens, other weights: nothing
        assert copy.block_keys(tokens) == k1 and copy.lookup(k1) == 6  # same weights elsewhere: all of it
        assert _same(copy.get(k1), k1)
        spaces = {ns["identity"]: ns for ns in daemon.stats()["namespaces"].values()}
        assert set(spaces) == {V1, V2} and spaces[V1]["blocks"] == 6 and spaces[V2]["blocks"] == 0


def test_a_value_of_another_identity_on_disk_is_a_counted_miss_never_data(daemon_factory):
    """A disk value swapped for the other weights' block under the same key (as a second daemon or a
    copied data directory could leave it): read while running, or found by the start-up scan."""
    d = daemon_factory(["--host-capacity", "1MiB", "--slab-bytes", "64KiB"], env=FAST_ENV)
    with d.client(model="model", identity=V1) as v1, d.client(model="model", identity=V2) as v2:
        keys = _keys(v1, 160, seed=1)  # 1.25 MiB: the first blocks leave host memory for the disk
        for i in range(0, len(keys), 16):
            v1.put(keys[i:i + 16], block_values(keys[i:i + 16]), durable=True)
        assert wait_for(lambda: v1.lookup_tiers(keys[:1]) == ["disk"], timeout=20)
        env = lmdb.open(os.path.join(d.data_dir, "disk"), subdir=True, map_size=1 << 32)
        with env.begin(write=True) as txn:
            txn.put(v1.fingerprint + keys[0], _blob_of(v2, keys, 0))
        env.close()
        try:
            got = v1.get(keys[:1])
            raise AssertionError(f"served a block of another identity: {got.shape}")
        except KeyMissing:
            pass
        disk = v1.stats()["tiers"]["disk"]
        assert disk["foreign"] == 1 and v1.lookup(keys[:1]) == 0
        assert _same(v1.get(keys[1:4]), keys[1:4])
        fp1, blob = v1.fingerprint, _blob_of(v2, keys, 1)
    d.stop()
    env = lmdb.open(os.path.join(d.data_dir, "disk"), subdir=True, map_size=1 << 32)
    with env.begin(write=True) as txn:
        txn.put(fp1 + keys[1], blob)
    env.close()
    d.start()
    with d.client(model="model", identity=V1) as v1:
        assert v1.stats()["tiers"]["disk"]["foreign"] == 1  # the scan dropped it: its header names V2
        assert v1.lookup(keys[1:2]) == 0
        assert _same(v1.get(keys[2:4]), keys[2:4])


@need_redis
def test_a_value_of_another_identity_in_redis_is_a_counted_miss_and_deleted(daemon_factory, redis_server):
    d = daemon_factory(["--remote", redis_server.url, "--remote-admission", "all", "--no-disk"])
    with d.client(model="model", identity=V1) as v1, d.client(model="model", identity=V2) as v2:
        keys = _keys(v1, 4, seed=2)
        admin = redis_server.admin()
        for i, k in enumerate(keys):  # what a daemon of the other weights could have written
            admin.set(remote_key(v1.fingerprint, k), _blob_of(v2, keys, i))
        assert v1.lookup_tiers(keys) == ["remote"] * 4  # present is not valid
        try:
            v1.get(keys)
            raise AssertionError("served a block of another identity from the remote tier")
        except KeyMissing:
            pass
        remote = v1.stats()["tiers"]["remote"]
        assert remote["foreign"] >= 1 and remote["hits"] == 0
        assert wait_for(lambda: admin.exists(remote_key(v1.fingerprint, keys[0])) == 0, timeout=10)


def test_blocks_of_the_earlier_format_are_dropped_at_start_and_doctor_says_so(daemon_factory):
    d = daemon_factory(env=FAST_ENV)
    with d.client(model="model", identity=V1) as c:
        keys = _keys(c, 6, seed=3)
        c.put(keys, block_values(keys), durable=True)
        fp = c.fingerprint
    d.stop()
    env = lmdb.open(os.path.join(d.data_dir, "disk"), subdir=True, map_size=1 << 32)
    with env.begin(write=True) as txn:
        for k in keys[:4]:  # as the earlier tierkv wrote them (its header hash made to match)
            txn.put(fp + k, as_earlier_format(bytes(txn.get(fp + k))))
    env.close()
    d.start()
    with d.client(model="model", identity=V1) as c:
        disk = c.stats()["tiers"]["disk"]
        assert disk["earlier_format"] == 4 and disk["blocks"] == 2 and disk["corrupt"] == 0
        assert c.lookup(keys) == 0 and c.lookup(keys[4:]) == 2
    scan = json.loads((d.workdir / "data" / "last-scan.json").read_text())
    assert (scan["blocks"], scan["earlier_format"], scan["foreign"], scan["corrupt"]) == (2, 4, 0, 0)
    assert time.time() - scan["at"] < 600
    r = CliRunner().invoke(admin_cli.doctor, ["--socket", d.socket, "--data-dir", d.data_dir])
    assert "found 2 disk blocks and dropped 4 of an earlier format" in r.output, r.output

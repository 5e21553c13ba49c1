"""The shared lookup index: the C table against a reference set, and a real daemon whose clients answer
``lookup`` from it (checked against the daemon's own socket answer)."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import random
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tierkv
from tests.helpers import SMALL
from tierkv.core import protocol
from tierkv.core.errors import ConnectionFailed
from tierkv.core.lookup_index import IndexedBlocks, LookupIndex, available

pytestmark = pytest.mark.skipif(not available(), reason="tierkv._native._lookup did not build")

FP = bytes(range(16))


def _table(slots: int) -> tuple[mmap.mmap, object]:
    from tierkv._native import _lookup

    mm = mmap.mmap(-1, 64 + 8 * slots)
    assert _lookup.init(mm) == slots
    return mm, _lookup


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 300)), max_size=1500), st.integers(0, 2**32))
def test_table_matches_a_set_through_inserts_and_deletes(ops, seed):
    mm, L = _table(512)  # up to 384 keys: ops near the load limit, with wrap-around runs
    keys = [random.Random(seed + i).randbytes(1 + i % 40) for i in range(301)]
    ref: set[bytes] = set()
    for add, i in ops:
        fk = FP + keys[i]
        if add:
            r = L.insert(mm, fk)
            if r == -1:
                assert len(ref) >= 384
                continue
            assert r == (0 if keys[i] in ref else 1)
            ref.add(keys[i])
        else:
            assert L.remove(mm, fk) == (1 if keys[i] in ref else 0)
            ref.discard(keys[i])
    for k in keys:
        assert L.prefix(mm, FP, [k]) == (1 if k in ref else 0)
    assert L.info(mm)[1] == len(ref)


def test_prefix_stops_at_the_first_missing_key_and_reports_overflow():
    mm, L = _table(1024)
    keys = [os.urandom(32) for _ in range(64)]
    for k in keys[:40] + keys[41:]:
        L.insert(mm, FP + k)
    assert L.prefix(mm, FP, keys) == 40
    assert L.prefix(mm, FP, []) == 0
    assert L.prefix(mm, bytes(16), keys) == 0  # another namespace's fingerprint
    for i in range(800):  # past 3/4 of 1024: the table marks itself incomplete
        L.insert(mm, FP + i.to_bytes(4, "little"))
    assert L.info(mm)[2] is True
    assert L.prefix(mm, FP, keys) == -1  # the client asks the daemon instead
    with pytest.raises(ValueError):
        L.prefix(mm, FP, [b""])
    with pytest.raises(ValueError):
        L.prefix(bytearray(8), FP, keys)


def test_indexed_blocks_overflow_then_rebuild_when_it_fits_again():
    idx = LookupIndex(1024)
    try:
        blocks = IndexedBlocks(idx)
        for i in range(900):
            blocks[FP + i.to_bytes(4, "little")] = i
        assert idx.overflowed and idx.info()["overflow"]
        for i in range(900 - 400):
            del blocks[FP + i.to_bytes(4, "little")]
        assert not idx.overflowed and idx.info() == {"slots": 1024, "keys": 400, "overflow": False}
        from tierkv._native import _lookup

        present = [i.to_bytes(4, "little") for i in range(500, 900)]
        assert _lookup.prefix(idx._mm, FP, present) == 400
        assert blocks.pop(FP + present[0]) == 500 and blocks.pop(b"nope", None) is None
        with pytest.raises(NotImplementedError):
            blocks.clear()
    finally:
        idx.close()


def test_clients_cannot_map_the_index_writable():
    idx = LookupIndex(1024)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(idx.fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        idx.close()


# ---- a real daemon -------------------------------------------------------------------------------
def _blocks(n: int, layout: tierkv.Layout = SMALL, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.batch_shape(n), generator=g).to(layout.torch_dtype)


def _keys(c: tierkv.Client, n: int, seed: int) -> list[bytes]:
    return c.block_keys(np.random.default_rng(seed).integers(0, 50000, n * c.layout.block_tokens))


def _daemon_count(c: tierkv.Client, keys: list[bytes]) -> int:
    return int(c._call(protocol.Op.LOOKUP, {"keys": keys})["count"])


def test_lookups_come_from_the_index_without_a_request(daemon):
    with daemon.client() as c:
        assert c._index is not None
        keys = _keys(c, 64, seed=1)
        c.put(keys[:30], _blocks(30))
        before = c.stats()["requests"]
        for _ in range(50):
            assert c.lookup(keys) == 30
        assert c.stats()["requests"] == before + 1  # the stats call itself: no lookup reached the daemon
        assert c.stats()["lookup_index"]["keys"] == 30
        c.put(keys[30:], _blocks(34, seed=2))
        assert c.lookup(keys) == 64 == _daemon_count(c, keys)
        with tierkv.Client.connect(daemon.socket, model="other-model", layout=SMALL) as other:
            assert other.lookup(keys) == 0  # namespaces stay apart in the index too


def test_index_follows_eviction_drops_and_restart(daemon_factory):
    big = tierkv.Layout(4, 4, 64, 16, "bfloat16")  # 64 KiB blocks
    d = daemon_factory(["--host-capacity", "4MiB", "--slab-bytes", "1MiB", "--disk-capacity", "8MiB",
                        "--codec", "raw"], env={"TIERKV_DISK_ADMISSION": "all"})
    with d.client(layout=big) as c:
        keys = _keys(c, 300, seed=3)  # 18.75 MiB through 4 MiB of host and 8 MiB of disk: drops
        for i in range(0, 300, 20):
            c.put(keys[i:i + 20], _blocks(20, big, seed=i))
        time.sleep(1.0)
        for i in range(0, 300, 10):
            assert c.lookup(keys[i:i + 10]) == _daemon_count(c, keys[i:i + 10])
        held = sum(c.lookup([k]) for k in keys)
        assert 0 < held < 300
        assert c.stats()["lookup_index"]["keys"] == held
    d.restart()  # the index is rebuilt from the disk tier's scan
    with d.client(layout=big) as c:
        on_disk = c.stats()["tiers"]["disk"]["blocks"]
        assert sum(c.lookup([k]) for k in keys) == on_disk == c.stats()["lookup_index"]["keys"]


def test_a_full_index_falls_back_to_the_daemon(daemon_factory):
    d = daemon_factory(env={"TIERKV_SERVER_LOOKUP_INDEX_SLOTS": "1024"})
    with d.client() as c:
        keys = _keys(c, 1000, seed=4)
        for i in range(0, 1000, 100):
            c.put(keys[i:i + 100], _blocks(100, seed=i))
        assert c.stats()["lookup_index"]["overflow"] is True
        before = c.stats()["requests"]
        assert c.lookup(keys) == 1000 and c.lookup(keys[:64]) == 64
        assert c.stats()["requests"] == before + 3  # both lookups went to the daemon


def test_index_off_and_bad_setting(daemon_factory):
    d = daemon_factory(env={"TIERKV_SERVER_LOOKUP_INDEX_SLOTS": "0"})
    with d.client() as c:
        assert c._index is None and c.stats()["lookup_index"] is None
        keys = _keys(c, 8, seed=5)
        c.put(keys[:5], _blocks(5))
        assert c.lookup(keys) == 5
    bad = daemon_factory(["--log-level", "error"], start=False, env={"TIERKV_SERVER_LOOKUP_INDEX_SLOTS": "100"})
    with pytest.raises(RuntimeError, match="lookup_index_slots"):
        bad.start()
    assert "Traceback" not in bad.log.read_text()  # one clear line


def test_lookup_after_the_daemon_died_is_an_error(daemon):
    c = daemon.client()
    keys = _keys(c, 4, seed=6)
    c.put(keys, _blocks(4))
    assert c.lookup(keys) == 4
    daemon.kill()
    with pytest.raises(ConnectionFailed):
        c.lookup(keys)
    c.close()


def _churn(sock: str, seconds: float) -> None:
    with tierkv.Client.connect(sock, model="test-model", layout=SMALL) as c:
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            c.put(_keys(c, 16, seed=1000 + i % 40), _blocks(16, seed=i))
            i += 1


def test_lookups_beside_a_writer_in_another_process(daemon_factory):
    """Lookups read the index while another process stores and the host tier evicts: never an error,
    never more than was stored, and the same answer as the daemon's once the writer stops."""
    d = daemon_factory(["--host-capacity", "4MiB", "--slab-bytes", "1MiB"])
    writer = mp.get_context("spawn").Process(target=_churn, args=(d.socket, 4.0))
    writer.start()
    with d.client() as c:
        sets = [_keys(c, 16, seed=1000 + j) for j in range(40)]
        seen = 0
        while writer.is_alive():
            for ks in sets:
                n = c.lookup(ks)
                assert 0 <= n <= 16
                seen += n
        writer.join()
        assert writer.exitcode == 0 and seen > 0
        for ks in sets:
            assert c.lookup(ks) == _daemon_count(c, ks)


def test_stats_cli_shows_the_index(daemon):
    import json
    import subprocess
    import sys

    with daemon.client() as c:
        c.put(_keys(c, 3, seed=8), _blocks(3))
    run = [sys.executable, "-m", "tierkv", "stats", "--socket", daemon.socket]
    human = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert human.returncode == 0 and "lookup index: 3 keys in" in human.stdout
    as_json = json.loads(subprocess.run([*run, "--json"], capture_output=True, text=True, timeout=60).stdout)
    assert as_json["lookup_index"]["keys"] == 3

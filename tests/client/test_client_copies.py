"""The client's host copies, fresh batches and durable chunks, and what `import tierkv.client` loads."""

from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np
import pytest
import torch

import tierkv.client.client
import tierkv.client.copies as copies
from tests.helpers import REPO, SMALL, keys_for, rand_blocks
from tierkv.client.durable import durable_chunks, slot_bytes
from tierkv.core.errors import BadRequest, KeyMissing
from tierkv.core.layout import Layout

LLAMA = Layout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16, dtype="bfloat16")


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_copy_pairs_copies_every_pair_on_any_thread_count(threads, monkeypatch):
    monkeypatch.setattr(copies, "PER_THREAD_BYTES", 1 << 16)  # split even a small batch
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rng = np.random.default_rng(threads)
        srcs = [rng.integers(0, 255, 1 << 17, dtype=np.uint8) for _ in range(9)]
        dsts = [np.zeros_like(s) for s in srcs]
        copies.copy_pairs(list(zip(dsts, srcs)))
        assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs))
        copies.copy_pairs([])
    finally:
        torch.set_num_threads(before)


def test_copy_pairs_reports_a_failed_copy_after_every_worker_is_done(monkeypatch):
    monkeypatch.setattr(copies, "PER_THREAD_BYTES", 1 << 10)
    src, short = np.ones(1 << 12, np.uint8), np.zeros(1 << 11, np.uint8)
    with pytest.raises(ValueError, match="size mismatch"):
        copies.copy_pairs([(np.zeros_like(src), src), (short, src)])


def test_new_batch_is_a_writable_batch_that_outlives_its_mapping_reference():
    small = copies.new_batch(SMALL, 3)
    assert small.shape == SMALL.batch_shape(3) and small.dtype == SMALL.torch_dtype
    big = copies.new_batch(LLAMA, 3)  # 6 MiB: its own mapping
    gc.collect()
    big.fill_(1.5)
    assert big.shape == LLAMA.batch_shape(3) and big.is_contiguous() and float(big[2, 1, 31, 7, 15, 127]) == 1.5
    assert copies.new_batch(LLAMA, 0).shape == LLAMA.batch_shape(0)


def test_durable_chunks_are_capped_by_the_host_tier():
    mib2 = 2 << 20
    assert slot_bytes(8192) == 8192 and slot_bytes(8193) == 12288
    chunks = durable_chunks(64, mib2, host_bytes=32 << 20)  # at most 4 blocks (8 MiB) a chunk
    assert chunks[0] == (0, 2) and max(hi - lo for lo, hi in chunks) <= 4 + 2
    assert chunks[-1][1] == 64 and all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert durable_chunks(3, mib2, host_bytes=4 << 20) == [(0, 1), (1, 3)]  # the tail rides along
    assert durable_chunks(64, mib2) == durable_chunks(64, mib2, host_bytes=1 << 40)


def test_importing_the_client_loads_neither_the_daemon_nor_redis_nor_lmdb():
    code = ("import sys, tierkv.client; import tierkv; tierkv.Client; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('redis', 'lmdb', 'zstandard') or "
            "m.startswith(('tierkv.daemon', 'tierkv.movers', 'tierkv.tiers', 'tierkv.cache', 'tierkv.codecs'))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def _leases(c) -> int:
    return sum(s["leases"] for s in c.stats()["sessions"])


def test_get_of_a_large_batch_reads_back_equal_and_releases_its_lease(daemon):
    with daemon.client() as c:
        n = (6 << 20) // SMALL.block_bytes  # above copies.HUGE_BYTES: a batch of its own mapping
        keys, blocks = keys_for(c, n, seed=11), rand_blocks(n, seed=11)
        assert c.put(keys, blocks) == n
        got = c.get(keys)
        assert torch.equal(got.view(torch.int16), blocks.view(torch.int16))
        out = torch.zeros_like(blocks)
        assert c.get(keys, out=out) is out and torch.equal(out.view(torch.int16), blocks.view(torch.int16))
        prefix = c.get_prefix(keys)
        assert torch.equal(prefix.view(torch.int16), blocks[:prefix.shape[0]].view(torch.int16))
        with pytest.raises(KeyMissing, match="first missing at index 2"):
            c.get(keys[:2] + keys_for(c, 1, seed=12))
        assert _leases(c) == 0


def test_get_into_a_wrong_out_is_a_clear_error(daemon):
    with daemon.client() as c:
        keys = keys_for(c, 2, seed=13)
        c.put(keys, rand_blocks(2, seed=13))
        with pytest.raises(BadRequest, match="out must be a contiguous"):
            c.get(keys, out=torch.zeros(SMALL.batch_shape(3), dtype=SMALL.torch_dtype))
        with pytest.raises(BadRequest, match="out must be a contiguous"):
            c.get(keys, out=torch.zeros(SMALL.batch_shape(2), dtype=torch.float32))
        assert _leases(c) == 0


def test_a_failed_copy_gives_its_slots_back_and_stores_nothing(daemon, monkeypatch):
    def fail(pairs):
        raise RuntimeError("copy failed")

    with daemon.client() as c:
        keys = keys_for(c, 8, seed=14)
        monkeypatch.setattr(tierkv.client.client, "copy_pairs", fail)
        with pytest.raises(RuntimeError, match="copy failed"):
            c.put(keys, rand_blocks(8, seed=14))
        monkeypatch.undo()
        assert c.lookup(keys) == 0 and c.stats()["tiers"]["host"]["used_bytes"] == 0
        assert c.put(keys, rand_blocks(8, seed=14)) == 8
        assert torch.equal(c.get(keys).view(torch.int16), rand_blocks(8, seed=14).view(torch.int16))


def test_copy_pairs_works_in_a_forked_child(monkeypatch):
    import os
    import signal

    monkeypatch.setattr(copies, "PER_THREAD_BYTES", 1 << 12)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        src = [np.full(1 << 14, i, np.uint8) for i in range(4)]
        copies.copy_pairs([(np.zeros_like(s), s) for s in src])  # the parent has made its executor
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if the copy finishes (within 30 s) and is right
            signal.alarm(30)
            dst = [np.zeros_like(s) for s in src]
            copies.copy_pairs(list(zip(dst, src)))
            os._exit(0 if all(np.array_equal(d, s) for d, s in zip(dst, src)) else 1)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
    finally:
        torch.set_num_threads(before)

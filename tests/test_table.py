"""The block table in-process: host, disk and GPU stand-in tiers in a tmp dir, no daemon process.

Each test drives the table's state machine directly (store, dedup, lookup, leases, eviction, drains)
and checks the records and the bytes in the slots.
"""

from __future__ import annotations

import numpy as np
import pytest

from tierkv.cache.table import BlockTable, Session
from tierkv.core.keys import Namespace
from tierkv.daemon.config import Config

from .helpers import SMALL

NS = Namespace("table-test", SMALL)
BLOCK = SMALL.block_bytes


def _config(tmp_path, gpu: bool = False, **host) -> Config:
    cfg = Config()
    cfg.server.data_dir = str(tmp_path)
    cfg.server.lookup_index_slots = 0
    cfg.host.capacity = host.get("capacity", 16 << 20)
    cfg.host.slab_bytes = 1 << 20
    cfg.host.prefault = False
    cfg.host.write_behind = host.get("write_behind", False)
    cfg.disk.capacity = 64 << 20
    cfg.disk.sync = False
    if gpu:
        cfg.gpu.capacity = 2 << 20
        cfg.gpu.slab_bytes = 1 << 20
        cfg.gpu.device = "cpu"
    return cfg


@pytest.fixture
def make_table(tmp_path):
    made: list[BlockTable] = []

    def make(gpu: bool = False, **host) -> BlockTable:
        d = tmp_path / f"t{len(made)}"
        d.mkdir()
        t = BlockTable(_config(d, gpu, **host), str(d))
        made.append(t)
        return t

    yield make
    for t in made:
        t.close(5.0)


def _session(t: BlockTable, sid: int = 1) -> Session:
    s = Session(sid)
    t.register(s, NS)
    return s


def _keys(n: int, start: int = 0) -> list[bytes]:
    return [i.to_bytes(8, "little") for i in range(start, start + n)]


def _fill(view, seed: int) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)
    if hasattr(view, "numpy"):
        view = view.numpy()
    view[:] = data
    return data.tobytes()


class _HeldCopies:
    """Holds the engine's GPU -> host copies until :meth:`run`, so a drain stays in flight."""

    def __init__(self, table: BlockTable) -> None:
        self.table, self.held = table, []
        self.real = table.engine.to_host
        table.engine.to_host = lambda copies, done: self.held.append((copies, done))

    def run(self) -> None:
        self.table.engine.to_host = self.real
        for copies, done in self.held:
            self.real(copies, done).done.wait(10)
        self.held.clear()


def test_fetch_names_the_gpu_for_a_block_still_draining_from_it(make_table):
    t = make_table(gpu=True)
    s = _session(t)
    keys = _keys(2)
    held = _HeldCopies(t)
    offs = t.alloc(s, 2, keys, "gpu")
    data = [_fill(t.gpu.view(off, BLOCK), i) for i, off in enumerate(offs)]
    assert t.commit(s, keys, offs, tier="gpu") == 2
    assert all(t.blocks[s.fp + k].draining for k in keys)
    ticket = t.fetch(s, keys)
    held.run()
    lease, slots, tiers = t.wait(s, ticket, 10.0)
    assert tiers == ["gpu", "gpu"], "a draining block is served from the GPU, not the disk"
    assert [t.host.view(off, BLOCK).tobytes() for off in slots] == data
    t.release(s, [lease])

"""The contract every tier keeps, each behaviour one test body run against every tier: host (memfd
slabs), disk (LMDB) and gpu (the device pool; its CPU stand-in, and CUDA where there is a GPU).

A tier stores bytes under a handle and reads them back exactly; a freed place is used again; it never
holds more than its room and says "no room" without losing what it holds; bad input is a ValueError that
changes nothing. Each tier keeps its own primitives (slots for the pools, keys for LMDB); an adapter
below maps them onto the same few calls.

The remote tier is not among them: Redis evicts under its own ``maxmemory`` policy instead of refusing
a value, so it has no room to keep; its store/read/bad-input behaviour is tested against real Redis
in ``tests/tiers/test_remote_tier.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from tierkv.core.errors import TierFull
from tierkv.tiers.disk import DiskTier, stored_size
from tierkv.tiers.host import HostPool, slot_size_for

MIB = 1 << 20


class PoolAdapter:
    """A slab pool (host, gpu): a handle is a slot; "no room" is ``alloc`` returning None."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.slots: dict[bytes, tuple[int, int]] = {}

    @property
    def room(self) -> int:
        return self.pool.capacity

    def store(self, key: bytes, data: bytes) -> bool:
        off = self.pool.alloc(slot_size_for(len(data)))
        if off is None:
            return False
        self._write(off, data)
        self.slots[key] = (off, len(data))
        return True

    def read(self, key: bytes) -> bytes | None:
        if key not in self.slots:
            return None
        off, n = self.slots[key]
        return self._read(off, n)

    def free(self, key: bytes) -> None:
        off, _n = self.slots.pop(key)
        self.pool.free(off)

    def used(self) -> int:
        return self.pool.used_bytes

    def bad_calls(self) -> Iterator[Callable[[], object]]:
        held = next(iter(self.slots.values()))[0] if self.slots else 0
        yield lambda: self.pool.alloc(self.pool.slab_bytes + 4096)  # a slot larger than a slab
        yield lambda: self.pool.alloc(0)
        yield lambda: self.pool.free(self.pool.capacity)            # outside the pool
        yield lambda: self.pool.free(held + 1)                      # not a slot's start
        yield lambda: self.pool.free(-4096)

    def free_twice(self, key: bytes) -> None:
        off, _n = self.slots[key]
        self.free(key)
        with pytest.raises(ValueError):
            self.pool.free(off)

    def close(self) -> None:
        self.pool.close()


class HostAdapter(PoolAdapter):
    def __init__(self, tmp: Path) -> None:
        super().__init__(HostPool(8 * MIB, 2 * MIB, prefault=False))

    def _write(self, off: int, data: bytes) -> None:
        self.pool.view(off, len(data))[:] = np.frombuffer(data, np.uint8)

    def _read(self, off: int, n: int) -> bytes:
        return self.pool.view(off, n).tobytes()


class GpuAdapter(PoolAdapter):
    device = "cpu"

    def __init__(self, tmp: Path) -> None:
        pytest.importorskip("torch")
        from tierkv.tiers.gpu import DevicePool

        super().__init__(DevicePool(8 * MIB, 2 * MIB, self.device))

    def _write(self, off: int, data: bytes) -> None:
        import torch

        self.pool.view(off, len(data)).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def _read(self, off: int, n: int) -> bytes:
        return self.pool.view(off, n).cpu().numpy().tobytes()


class CudaAdapter(GpuAdapter):
    device = "cuda"


class DiskAdapter:
    """The LMDB environment: a handle is a key; "no room" is :class:`TierFull` from a full map."""

    def __init__(self, tmp: Path) -> None:
        self.tier = DiskTier(tmp / "disk", 1 * MIB, sync=False)  # map: 1.25 MiB + 64 MiB

    @property
    def room(self) -> int:
        return self.tier.map_size

    def store(self, key: bytes, data: bytes) -> bool:
        try:
            self.tier.write([(key, data)])
        except TierFull:
            return False
        return True

    def read(self, key: bytes) -> bytes | None:
        return self.tier.read(key, bytes)

    def free(self, key: bytes) -> None:
        self.tier.delete([key])

    def used(self) -> int:
        return sum(stored_size(len(v)) for _k, v in self.tier.scan())

    def bad_calls(self) -> Iterator[Callable[[], object]]:
        yield lambda: self.tier.write([(b"", b"v")])
        yield lambda: self.tier.write([(b"k" * 600, b"v")])
        yield lambda: self.tier.write([(b"ok", b"v"), (b"", b"v")])  # one bad key: nothing is written
        yield lambda: self.tier.delete([b""])
        yield lambda: self.tier.read(b"", bytes)

    def free_twice(self, key: bytes) -> None:
        self.free(key)
        self.free(key)  # a missing key is ignored

    def close(self) -> None:
        self.tier.close()


ADAPTERS = {"host": HostAdapter, "disk": DiskAdapter, "gpu-standin": GpuAdapter, "gpu-cuda": CudaAdapter}
TIERS = ["host", "disk", "gpu-standin", pytest.param("gpu-cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=TIERS)
def tier(request, tmp_path: Path):
    t = ADAPTERS[request.param](tmp_path)
    yield t
    t.close()


def _value(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_store_then_read_is_exact(tier) -> None:
    values = {b"k%d" % i: _value(n, i) for i, n in enumerate([1, 100, 4095, 4096, 4097, 70_000, MIB])}
    for key, data in values.items():
        assert tier.store(key, data)
    for key, data in values.items():
        assert tier.read(key) == data
    assert tier.read(b"never-stored") is None


def test_used_follows_store_and_free(tier) -> None:
    assert tier.used() == 0
    tier.store(b"a", _value(MIB, 1))
    tier.store(b"b", _value(5000, 2))
    assert tier.used() >= MIB + 5000
    tier.free(b"a")
    assert 5000 <= tier.used() < MIB
    tier.free(b"b")
    assert tier.used() == 0


def test_full_says_no_room_and_keeps_what_it_holds(tier) -> None:
    stored: dict[bytes, bytes] = {}
    for i in range(tier.room // MIB + 2):
        key, data = b"f%d" % i, _value(MIB, i)
        if not tier.store(key, data):
            break
        stored[key] = data
    else:
        pytest.fail("the tier took more than its room")
    assert 0 < len(stored) and len(stored) * MIB <= tier.room and tier.used() <= tier.room
    assert tier.read(key) is None  # the refused value is not there
    assert all(tier.read(k) == v for k, v in stored.items())
    freed = list(stored)[:2]
    for k in freed:
        tier.free(k)
    assert tier.store(b"again", _value(MIB, 99))  # a freed place is used again
    assert tier.read(b"again") == _value(MIB, 99)
    assert all(tier.read(k) == v for k, v in stored.items() if k not in freed)


def test_bad_input_is_a_value_error_that_changes_nothing(tier) -> None:
    tier.store(b"x", _value(3000, 5))
    tier.store(b"y", _value(MIB, 6))
    before = tier.used()
    for call in tier.bad_calls():
        with pytest.raises(ValueError):
            call()
    assert tier.used() == before
    assert tier.read(b"x") == _value(3000, 5) and tier.read(b"y") == _value(MIB, 6)
    assert tier.read(b"ok") is None


def test_a_second_free_loses_nothing(tier) -> None:
    tier.store(b"p", _value(4096, 7))
    tier.store(b"q", _value(4096, 8))
    tier.free_twice(b"p")
    assert tier.read(b"q") == _value(4096, 8)
    tier.store(b"r", _value(4096, 9))  # the freed place goes to one new value, not two
    tier.store(b"s", _value(4096, 10))
    assert tier.read(b"q") == _value(4096, 8) and tier.read(b"r") == _value(4096, 9)
    assert tier.read(b"s") == _value(4096, 10)

"""A Hypothesis state machine drives put / get / acquire (pin) / release / delete (evict) / alloc /
disconnect against one live daemon and checks every reply against a model.

Invariants after every step: lease counts match the model and are never negative, host and disk usage
never exceed capacity. The host tier is tiny (16 slots) so blocks keep moving to disk and back; every
host victim is written to disk (``disk.admission=all``), so a block is only ever gone when deleted and
a get after a put must return it. Blocks are content-addressed: a second put of a key is deduplicated
and either copy may be served afterwards (the daemon adopts a fresh copy of a block that is on disk
only), so the model accepts the bytes of any put of that key since it was first stored, never others.
"""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import tierkv
from tests.helpers import FAST_ENV, Daemon, wait_for
from tierkv.client.admin import request
from tierkv.core.errors import BadRequest, KeyMissing
from tierkv.core.layout import Layout
from tierkv.core.protocol import Op

LAYOUT = Layout(4, 4, 64, 16, "bfloat16")  # 64 KiB blocks; the host tier holds 16
UNIVERSE = 48  # keys per example: three times what the host tier holds
# At worst 2 leases of 4 blocks and 2 open allocations of 2 slots pin 12 of the 16 slots, and a put of 4
# blocks takes the rest: the host tier can always make room, so TierFull would be a bug.
MAX_LEASES = 2
MAX_OPEN = 2

idx_lists = st.lists(st.integers(0, UNIVERSE - 1), min_size=1, max_size=4, unique=True)
client_ix = st.integers(0, 2)


def versioned(keys: list[bytes], versions: list[int]) -> np.ndarray:
    """Block bytes derived from (key, version): two puts of one key can carry different bytes."""
    n = LAYOUT.block_bytes // 2
    out = np.empty((len(keys), n), np.uint16)
    for i, (k, v) in enumerate(zip(keys, versions)):
        seed = int.from_bytes(hashlib.blake2b(k + bytes([v]), digest_size=8).digest(), "little")
        out[i] = np.random.default_rng(seed).integers(0, 1 << 16, n, np.uint16)
    return out.reshape(LAYOUT.batch_shape(len(keys)))


class TierKVMachine(RuleBasedStateMachine):
    """Clients of one namespace (fresh for every example) against the live daemon at ``socket``."""

    socket = ""

    def __init__(self) -> None:
        super().__init__()
        self.model = f"sm-{uuid.uuid4().hex[:12]}"
        self.keys = [hashlib.blake2b(f"{self.model}/{i}".encode(), digest_size=16).digest() for i in range(UNIVERSE)]
        self.clients: list[tierkv.Client] = []
        self.stored: dict[int, set[int]] = {}  # key index -> versions whose bytes the daemon may serve
        self.leases: list[tuple[tierkv.Client, tierkv.client.client.Lease, list[int]]] = []
        self.released: list[tuple[tierkv.Client, int]] = []
        self.open_slots: list[tuple[tierkv.Client, tierkv.client.client.Slots]] = []

    # ---- helpers --------------------------------------------------------------------------------
    def _client(self, i: int) -> tierkv.Client:
        return self.clients[i % len(self.clients)]

    def _prefix(self, idx: list[int]) -> int:
        n = 0
        while n < len(idx) and idx[n] in self.stored:
            n += 1
        return n

    def _check(self, got: torch.Tensor, idx: list[int]) -> None:
        """Each block of ``got`` holds the bytes of one of the puts of its key."""
        u16 = got.view(torch.int16).numpy().view(np.uint16)
        for block, j in zip(u16, idx):
            ok = [v for v in self.stored[j] if np.array_equal(block, versioned([self.keys[j]], [v])[0])]
            assert ok, f"key {j}: bytes of none of its puts {sorted(self.stored[j])}"

    def _stored_now(self, idx: list[int], version: int) -> None:
        for j in idx:
            self.stored.setdefault(j, set()).add(version)

    def _leased(self) -> set[int]:
        return {i for _c, _l, idx in self.leases for i in idx}

    # ---- rules ----------------------------------------------------------------------------------
    @initialize()
    def first_client(self) -> None:
        self.connect()

    @precondition(lambda self: len(self.clients) < 3)
    @rule()
    def connect(self) -> None:
        self.clients.append(tierkv.Client.connect(self.socket, model=self.model, layout=LAYOUT))

    @precondition(lambda self: len(self.clients) > 1)
    @rule(i=client_ix)
    def disconnect(self, i: int) -> None:
        c = self.clients.pop(i % len(self.clients))
        self.leases = [x for x in self.leases if x[0] is not c]
        self.released = [x for x in self.released if x[0] is not c]
        self.open_slots = [x for x in self.open_slots if x[0] is not c]
        c.close()  # its leases and open slots are the daemon's to free now, as soon as it sees the close
        want = sum(len(idx) for _c, _l, idx in self.leases)
        assert wait_for(lambda: request(self.socket, "STATS")["leases"] == want, timeout=10)

    @rule(i=client_ix, idx=idx_lists, version=st.integers(0, 3), durable=st.booleans())
    def put(self, i: int, idx: list[int], version: int, durable: bool) -> None:
        keys = [self.keys[j] for j in idx]
        new = self._client(i).put(keys, versioned(keys, [version] * len(keys)), durable=durable)
        assert new == sum(1 for j in idx if j not in self.stored)
        self._stored_now(idx, version)

    @rule(i=client_ix, idx=idx_lists)
    def get(self, i: int, idx: list[int]) -> None:
        keys = [self.keys[j] for j in idx]
        c = self._client(i)
        assert c.lookup(keys) == self._prefix(idx)
        if self._prefix(idx) < len(idx):
            with pytest.raises(KeyMissing):
                c.get(keys)
            return
        self._check(c.get(keys), idx)

    @precondition(lambda self: len(self.leases) < MAX_LEASES)
    @rule(i=client_ix, idx=idx_lists)
    def acquire(self, i: int, idx: list[int]) -> None:
        c = self._client(i)
        lease = c.acquire([self.keys[j] for j in idx])
        n = self._prefix(idx)
        assert lease.count == n
        if n:
            self._check(torch.stack(lease.views), idx[:n])
        self.leases.append((c, lease, idx[:n]))

    @precondition(lambda self: self.leases)
    @rule(j=st.integers(0, MAX_LEASES))
    def release(self, j: int) -> None:
        c, lease, _idx = self.leases.pop(j % len(self.leases))
        lease.release()
        self.released.append((c, lease.id))

    @precondition(lambda self: self.released)
    @rule(j=st.integers(0, 8))
    def release_again(self, j: int) -> None:
        c, lease_id = self.released[j % len(self.released)]
        with pytest.raises(BadRequest):
            c._call(Op.RELEASE, {"leases": [lease_id]})

    @rule(i=client_ix, idx=idx_lists)
    def delete(self, i: int, idx: list[int]) -> None:
        c = self._client(i)
        keys = [self.keys[j] for j in idx]
        dropped = c.delete(keys)
        present = [c.lookup([k]) == 1 for k in keys]
        assert dropped == present.count(False)
        leased = self._leased()
        for j, here in zip(idx, present):
            if j in leased:
                assert here, "a leased block was deleted"
            elif not here:
                self.stored.pop(j, None)
            else:  # kept only because a disk write of it was in flight: it must still be the stored one
                assert j in self.stored

    @precondition(lambda self: len(self.open_slots) < MAX_OPEN)
    @rule(i=client_ix, n=st.integers(1, 2))
    def alloc(self, i: int, n: int) -> None:
        c = self._client(i)
        self.open_slots.append((c, c.alloc(n)))

    @precondition(lambda self: self.open_slots)
    @rule(data=st.data(), version=st.integers(0, 3))
    def commit(self, data: st.DataObject, version: int) -> None:
        c, slots = self.open_slots.pop(0)
        idx = data.draw(st.lists(st.integers(0, UNIVERSE - 1), min_size=len(slots), max_size=len(slots), unique=True))
        keys = [self.keys[j] for j in idx]
        vals = torch.from_numpy(versioned(keys, [version] * len(keys))).view(torch.bfloat16)
        for v, src in zip(slots.views, vals):
            v.copy_(src)
        assert slots.commit(keys) == sum(1 for j in idx if j not in self.stored)
        self._stored_now(idx, version)

    @precondition(lambda self: self.open_slots)
    @rule()
    def abort(self) -> None:
        _c, slots = self.open_slots.pop()
        slots.abort()

    # ---- invariants -----------------------------------------------------------------------------
    @invariant()
    def counts_within_bounds(self) -> None:
        s = request(self.socket, "STATS")
        assert s["leases"] >= 0
        assert s["leases"] == sum(len(idx) for _c, _l, idx in self.leases)
        for tier in ("host", "disk"):
            t = s["tiers"][tier]
            assert 0 <= t["used_bytes"] <= t["capacity_bytes"], (tier, t)

    def teardown(self) -> None:
        for c in self.clients:
            c.close()
        # the daemon frees what they held; wait so the next example starts from zero leases
        assert wait_for(lambda: request(self.socket, "STATS")["leases"] == 0, timeout=10)
        with tierkv.Client.connect(self.socket, model=self.model, layout=LAYOUT) as c:
            c.delete(self.keys)


@pytest.fixture(scope="module")
def sm_daemon(tmp_path_factory):
    d = Daemon(Path(tmp_path_factory.mktemp("statemachine")),
               ["--host-capacity", "1MiB", "--slab-bytes", "512KiB", "--disk-capacity", "256MiB"],
               env={**FAST_ENV, "TIERKV_DISK_ADMISSION": "all"})
    d.start()
    yield d
    d.stop()


def test_state_machine_against_live_daemon(sm_daemon):
    TierKVMachine.socket = sm_daemon.socket
    run_state_machine_as_test(TierKVMachine, settings=settings(
        max_examples=30, stateful_step_count=50, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]))
    assert sm_daemon.proc.poll() is None
    s = sm_daemon.stats()
    assert s["leases"] == 0
    assert "Exception in thread" not in sm_daemon.log.read_text()
    host, disk = s["tiers"]["host"], s["tiers"]["disk"]
    assert host["capacity_bytes"] == 1 << 20
    print(f"state machine: {s['requests']} requests; host evictions {host['evictions']}, "
          f"promotions {host['promotions']}; disk hits {disk['hits']}")

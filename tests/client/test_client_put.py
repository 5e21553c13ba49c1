"""Client.put and Client.get against a real daemon: sizes around the host tier's capacity."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import SMALL, keys_for, rand_blocks
from tierkv.core.errors import BadRequest, KeyMissing

HOST = 4 << 20  # the host tier of these tests: 512 blocks of SMALL


def _small_host(daemon_factory):
    return daemon_factory(["--host-capacity", "4MiB", "--slab-bytes", "1MiB"])


def test_durable_put_larger_than_the_host_tier_streams_to_disk(daemon_factory):
    d = _small_host(daemon_factory)
    n = 3 * HOST // SMALL.block_bytes
    with d.client() as c:
        keys, blocks = keys_for(c, n, seed=3), rand_blocks(n, seed=3)
        assert c.put(keys, blocks, durable=True) == n
        assert c.stats()["tiers"]["disk"]["blocks"] == n
        for lo in range(0, n, 128):  # read back in batches the host tier holds
            got = c.get(keys[lo:lo + 128])
            assert torch.equal(got.view(torch.int16), blocks[lo:lo + 128].view(torch.int16))


def test_get_of_more_blocks_than_the_host_tier_holds_streams_from_disk(daemon_factory):
    """A ``get`` as large as the durable put before it (three host tiers of blocks) returns them all,
    read through the host tier in chunks; a missing block names its index in the whole request."""
    d = _small_host(daemon_factory)
    n = 3 * HOST // SMALL.block_bytes
    with d.client() as c:
        keys, blocks = keys_for(c, n, seed=5), rand_blocks(n, seed=5)
        c.put(keys, blocks, durable=True)
        assert torch.equal(c.get(keys).view(torch.int16), blocks.view(torch.int16))
        c.delete(keys[n - 10:n - 9])
        with pytest.raises(KeyMissing, match=f"first missing at index {n - 10}"):
            c.get(keys)


def test_durable_put_below_the_first_chunk_but_above_the_host_tier(daemon_factory):
    d = daemon_factory(["--host-capacity", "2MiB", "--slab-bytes", "1MiB"])
    n = (3 << 20) // SMALL.block_bytes  # 3 MiB: one chunk by size, more than the host tier holds
    with d.client() as c:
        keys, blocks = keys_for(c, n, seed=4), rand_blocks(n, seed=4)
        assert c.put(keys, blocks, durable=True) == n
        assert torch.equal(c.get(keys[-64:]).view(torch.int16), blocks[-64:].view(torch.int16))


def test_plain_put_larger_than_the_host_tier_is_a_clear_error(daemon_factory):
    d = _small_host(daemon_factory)
    n = 2 * HOST // SMALL.block_bytes
    with d.client() as c:
        keys = keys_for(c, n, seed=5)
        with pytest.raises(BadRequest, match="exceed the host tier"):
            c.put(keys, rand_blocks(n, seed=5))
        assert c.lookup(keys) == 0
        small = keys_for(c, 4, seed=6)
        assert c.put(small, rand_blocks(4, seed=6)) == 4  # the connection is still usable
        assert torch.equal(c.get(small).view(torch.int16), rand_blocks(4, seed=6).view(torch.int16))


def test_a_put_continuing_a_cached_prefix_keeps_the_chain_whole(daemon_factory):
    """Chains stored a piece at a time (a prefix, then what later turns added) with ``parent``: the host
    tier takes each chain from its tail, so every chain keeps a cached prefix (without it each piece
    is a chain of its own, and an older piece, a prefix of the newer ones, goes first)."""
    d = daemon_factory(["--host-capacity", "1MiB", "--slab-bytes", "1MiB", "--no-disk"])
    with d.client() as c:  # 8 KiB blocks: 128 slots
        chains = [keys_for(c, 24, seed=200 + i) for i in range(4)]
        for i, keys in enumerate(chains):
            blocks = rand_blocks(24, seed=200 + i)
            for lo in (0, 8, 16):
                c.put(keys[lo:lo + 8], blocks[lo:lo + 8], parent=keys[lo - 1] if lo else None)
        for i in range(8):  # 64 more blocks: about 40 of the chains' must go
            c.put(keys_for(c, 8, seed=300 + i), rand_blocks(8, seed=300 + i))
        held = [[c.lookup([k]) for k in keys] for keys in chains]
        assert 0 < sum(map(sum, held)) < 96
        for h in held:
            assert h == sorted(h, reverse=True), f"a chain lost a block before its tail: {h}"
        with pytest.raises(BadRequest, match="parent"):
            c.put(chains[0][:2], rand_blocks(2), parent=chains[0][1])
        with pytest.raises(BadRequest, match="parent"):
            c.put(chains[0][:2], rand_blocks(2), parent="k")


def test_remote_is_a_bool_and_a_no_op_without_a_remote_tier(daemon_factory):
    """``remote=True`` on a daemon without a remote tier stores as a plain put (a streamed durable put
    too); anything but a bool is refused before a slot is taken or given up."""
    d = _small_host(daemon_factory)
    n = 300  # three chunks of a durable put through this host tier
    with d.client() as c:
        keys, blocks = keys_for(c, n, seed=7), rand_blocks(n, seed=7)
        for bad in ("yes", 1, None, 1.0):
            with pytest.raises(BadRequest, match="remote"):
                c.put(keys, blocks, remote=bad)
        assert c.lookup(keys) == 0
        assert c.put(keys, blocks, durable=True, remote=True) == n
        assert c.stats()["tiers"]["disk"]["blocks"] == n
        assert torch.equal(c.get(keys[-64:]).view(torch.int16), blocks[-64:].view(torch.int16))
        more = keys_for(c, 2, seed=8)
        with c.alloc(2) as slots:
            for view, block in zip(slots.views, rand_blocks(2, seed=8)):
                view.copy_(block)
            with pytest.raises(BadRequest, match="remote"):
                slots.commit(more, remote=0)
            assert slots.commit(more, remote=True) == 2  # the slots were kept
        assert torch.equal(c.get(more).view(torch.int16), rand_blocks(2, seed=8).view(torch.int16))


def test_cached_answers_per_key_from_the_lookup_index(daemon):
    """``cached`` says per key whether a local tier holds it, without a round trip; without the index
    it cannot say. A commit may name cached blocks it skipped as uses, gone ones included."""
    with daemon.client() as c, daemon.client(lookup_index=False) as plain:
        keys = keys_for(c, 5, seed=9)
        c.put(keys[1:2], rand_blocks(1, seed=9))
        c.put(keys[3:5], rand_blocks(2, seed=10), parent=keys[2])
        assert c.cached(keys) == [False, True, False, True, True] and c.cached([]) == []
        assert plain.cached(keys) is None
        with c.alloc(1, keep=keys[3:5]) as slots:
            assert c.commit(keys[2:3], slots, chains=[(0, keys[1])], uses=[keys[1], b"gone"]) == 1
        assert c.lookup(keys) == 0 and c.lookup(keys[1:]) == 4
        with pytest.raises(BadRequest):
            c.alloc(1, keep=[b""])

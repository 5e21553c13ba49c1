"""KV events: a subscriber rebuilds the per-tier index of a real daemon from its ZMQ events (vLLM's
wire format) and matches ``tierkv stats`` after stores, evictions, demotions and a restart."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
import zmq

from tests.helpers import SMALL, Daemon
from tierkv.client.events import EventIndex
from tierkv.core.errors import BadRequest

BT = SMALL.block_tokens
MEDIA = {"gpu": "GPU", "host": "CPU", "disk": "DISK", "remote": "REMOTE"}


def stats_counts(d: Daemon) -> dict[str, int]:
    tiers = d.stats()["tiers"]
    return {MEDIA[t]: v["blocks"] for t, v in tiers.items() if v["blocks"]}


def settle(d: Daemon, index: EventIndex, timeout: float = 30.0) -> dict[str, int]:
    """Wait until the index and the daemon's figures agree twice in a row; returns them."""
    deadline, same = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        want, got = stats_counts(d), {m: n for m, n in index.counts().items() if n}
        same = same + 1 if want == got else 0
        if same >= 2:
            return want
        time.sleep(0.2)
    raise AssertionError(f"events index {index.counts()} never matched stats {stats_counts(d)}")


def chain(rng: np.random.Generator, blocks: int) -> np.ndarray:
    return rng.integers(0, 50_000, blocks * BT, dtype=np.int64)


@pytest.fixture
def daemon(tmp_path):
    ep, rep = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    # write-behind whether or not other processes keep the cores busy: the disk fills the same way on a
    # loaded machine
    d = Daemon(tmp_path, ["--kv-events", ep, "--kv-events-replay", rep], env={"TIERKV_HOST_WRITE_BEHIND_IDLE_CORES": "0"})
    d.ep, d.rep = ep, rep
    d.start(["--host-capacity", "2MiB", "--slab-bytes", "1MiB", "--disk-capacity", "3MiB"])
    yield d
    d.stop()


def test_index_from_events_matches_stats_through_evictions_demotions_and_a_restart(daemon):
    index = EventIndex(daemon.ep, replay=daemon.rep).start()
    try:
        rng = np.random.default_rng(0)
        expected: dict[bytes, list[int]] = {}
        with daemon.client() as c:
            for i in range(40):  # 40 chains of 8 blocks: ~2.5 MiB, past the host tier and the disk
                toks = chain(rng, 8)
                keys = c.block_keys(toks)
                data = rng.integers(0, 1 << 16, (8, *SMALL.block_shape), dtype=np.uint16)  # incompressible
                c.put(keys, data, tokens=toks, durable=i % 3 == 0)
                expected.update({k: toks[j * BT:(j + 1) * BT].tolist() for j, k in enumerate(keys)})
        counts = settle(daemon, index)
        s = daemon.stats()
        assert counts.get("CPU") and counts.get("DISK"), counts
        assert s["tiers"]["host"]["evictions"] > 0 and s["tiers"]["disk"]["evictions"] > 0
        for medium in ("CPU", "DISK"):
            for h, ids in index.held(medium).items():
                assert ids == expected[h], "every stored event carries the block's own token ids"
        assert s["events"]["events"] >= sum(counts.values()) and index.gaps == 0

        daemon.restart(["--host-capacity", "2MiB", "--slab-bytes", "1MiB", "--disk-capacity", "3MiB"])
        after = settle(daemon, index)
        assert set(after) == {"DISK"} and after["DISK"] > 0, after  # host memory is empty after a start
        disk = index.held("DISK")
        assert all(disk[h] == expected[h] for h in disk), "re-announced blocks carry their token ids"
        assert index.gaps >= 1  # the restart's numbers jump; the replay filled the gap
    finally:
        index.close()


def test_late_subscriber_replays_and_events_decode_as_vllms(daemon):
    """A subscriber that joins late rebuilds the same index from the replay buffer, and every payload
    decodes with vLLM's own event classes."""
    rng = np.random.default_rng(1)
    with daemon.client() as c:
        for _ in range(4):
            toks = chain(rng, 4)
            c.put(c.block_keys(toks), np.zeros((4, *SMALL.block_shape), dtype=np.uint16), tokens=toks)
    first = EventIndex(daemon.ep, replay=daemon.rep).start()
    try:
        assert settle(daemon, first) == {"CPU": 16}
    finally:
        first.close()
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    import msgspec

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(daemon.rep)
    sock.send_multipart((b"", (0).to_bytes(8, "big")))
    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    kinds = []
    while sock.poll(5000):
        frames = sock.recv_multipart()
        if int.from_bytes(frames[-2], "big", signed=True) == -1:
            break
        batch = decoder.decode(frames[-1])
        kinds += [type(e).__name__ for e in batch.events]
        for e in batch.events:
            if isinstance(e, kv_events.BlockStored):
                assert e.medium == "CPU" and e.block_size == BT and len(e.token_ids) == BT * len(e.block_hashes)
    sock.close(0)
    ctx.term()
    assert kinds[0] == "AllBlocksCleared" and kinds.count("BlockStored") == 16


def test_gpu_and_remote_media(tmp_path):
    """The GPU tier (its CPU stand-in here) and the remote tier (a real Redis) report as the host and
    disk tiers do: the index matches every tier of ``tierkv stats``."""
    from tests.redis_servers import REDIS_CLI, REDIS_SERVER, RedisServer

    if not (REDIS_SERVER and REDIS_CLI):
        pytest.skip("redis-server not on PATH (tools/ensure_services.sh installs it)")
    redis = RedisServer().start()
    ep, rep = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    d = Daemon(tmp_path, ["--kv-events", ep, "--kv-events-replay", rep, "--remote", redis.url,
                          "--remote-admission", "all", "--gpu-capacity", "1MiB", "--gpu-device", "cpu",
                          "--slab-bytes", "1MiB"]).start()
    index = EventIndex(ep, replay=rep).start()
    try:
        rng = np.random.default_rng(3)
        with d.client() as c:
            for _ in range(24):  # 192 blocks of 8 KiB through a 1 MiB GPU tier
                toks = chain(rng, 8)
                data = rng.integers(0, 1 << 16, (8, *SMALL.block_shape), dtype=np.uint16)
                c.put(c.block_keys(toks), data, tier="gpu", tokens=toks)
        counts = settle(d, index)
        assert {"GPU", "CPU", "REMOTE"} <= set(counts), counts
        assert d.stats()["tiers"]["gpu"]["evictions"] > 0
    finally:
        index.close()
        d.stop()
        redis.stop()


def test_bad_tokens_are_refused_and_store_nothing(daemon):
    rng = np.random.default_rng(2)
    toks = chain(rng, 2)
    with daemon.client() as c:
        keys = c.block_keys(toks)
        blocks = np.zeros((2, *SMALL.block_shape), dtype=np.uint16)
        with pytest.raises(BadRequest, match="token ids"):
            c.put(keys, blocks, tokens=toks[:-1])
        with pytest.raises(BadRequest, match="0..2"):
            c.put(keys, blocks, tokens=-toks - 1)
        slots = c.alloc(2)
        with pytest.raises(BadRequest, match="tokens must be"):  # past the client's check: the daemon's
            c._call(__import__("tierkv.core.protocol", fromlist=["Op"]).Op.COMMIT,
                    {"keys": keys, "slots": slots.offsets, "tier": "host", "tokens": b"\0" * 7})
        slots.commit(keys, tokens=toks)  # the slots stayed committable
        assert c.lookup(keys) == 2
    assert msgpack  # the wire is msgpack (imported for readers of this module)


@pytest.mark.parametrize("endpoint", ["foo", "tcp://127.0.0.1:99999", "tcp://127.0.0.1"])
def test_bad_endpoints_are_one_line_errors(tmp_path, endpoint):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "tierkv", "serve", "--kv-events", endpoint, "--socket",
                        str(tmp_path / "s"), "--data-dir", str(tmp_path / "d")], capture_output=True, text=True,
                       timeout=60, env={**__import__("os").environ, "TIERKV_NO_REEXEC": "1"})
    assert r.returncode == 2 and "events.endpoint" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1

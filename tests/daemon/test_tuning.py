"""Runtime tuning, pinned prefixes, sequence windows and admission on a live daemon."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import tierkv
from tests.helpers import keys_for, rand_blocks
from tierkv.core.errors import BadRequest, TierFull
from tierkv.ops.cli import main

BIG = tierkv.Layout(4, 4, 64, 16, "bfloat16")  # 64 KiB blocks


def test_tune_policy_and_config_cli(daemon):
    r = CliRunner().invoke(main, ["tune", "--socket", daemon.socket, "policy.beta=0.7"])  # attention's weight
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["tune", "--socket", daemon.socket, "host.policy=lru"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["config", "--socket", daemon.socket, "--json"])
    cfg = json.loads(r.output)
    assert cfg["settings"]["host"]["policy"] == "lru" and cfg["sources"]["host.policy"] == "tune"
    assert cfg["settings"]["policy"]["beta"] == "0.7"
    assert daemon.stats()["tiers"]["host"]["policy"] == "lru"
    # bad keys or values: one line, non-zero exit, nothing changed
    for bad in (["host.policy=nope"], ["host.colour=1"], ["host.policy=gdsf", "host.capacity=1PiB"],
                ["server.socket=/x"], ["policy.nonsense=1"], ["noequals"]):
        r = CliRunner().invoke(main, ["tune", "--socket", daemon.socket, *bad])
        assert r.exit_code != 0 and "Traceback" not in r.output
    assert daemon.stats()["tiers"]["host"]["policy"] == "lru"
    r = CliRunner().invoke(main, ["config", "--socket", daemon.socket])
    assert "host.policy = 'lru'  (tune)" in r.output


def test_tune_disk_idle_aging(daemon):
    def half_life() -> float:
        r = CliRunner().invoke(main, ["stats", "--socket", daemon.socket, "--json"])
        return json.loads(r.output)["tiers"]["disk"]["idle_half_life_s"]

    assert half_life() == 0.5 * 300  # the configured multiple of the starting mean idle time
    r = CliRunner().invoke(main, ["tune", "--socket", daemon.socket, "disk.idle_aging=1.2"])
    assert r.exit_code == 0, r.output
    assert half_life() == 1.2 * 300
    for bad in ("disk.idle_aging=-1", "disk.idle_aging=soon", "disk.idle_aging=inf", "policy.idle_aging=inf"):
        r = CliRunner().invoke(main, ["tune", "--socket", daemon.socket, bad])
        assert r.exit_code != 0 and "Traceback" not in r.output and "idle_aging" in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1, r.output
    assert half_life() == 1.2 * 300  # a refused value changes nothing
    r = CliRunner().invoke(main, ["config", "--socket", daemon.socket, "--json"])
    assert float(json.loads(r.output)["settings"]["disk"]["idle_aging"]) == 1.2


def test_tune_shrink_host_evicts(daemon_factory):
    d = daemon_factory(["--host-capacity", "16MiB", "--slab-bytes", "1MiB"],
                       env={"TIERKV_DISK_ADMISSION": "all"})
    with d.client(layout=BIG) as c:
        keys = keys_for(c, 80, seed=1)
        c.put(keys, rand_blocks(80, BIG, seed=1))  # 5 MiB
        r = CliRunner().invoke(main, ["tune", "--socket", d.socket, "host.capacity=4MiB"])
        assert r.exit_code == 0, r.output
        deadline = time.time() + 20
        while time.time() < deadline and c.stats()["tiers"]["host"]["used_bytes"] > 4 << 20:
            time.sleep(0.1)
        st = c.stats()["tiers"]
        assert st["host"]["used_bytes"] <= 4 << 20 and st["disk"]["blocks"] > 0
        want = rand_blocks(80, BIG, seed=1)
        for i in range(0, 80, 16):  # a lease must fit the (now smaller) host tier
            assert torch.equal(c.get(keys[i:i + 16]).view(torch.int16), want[i:i + 16].view(torch.int16))


def test_pinned_prefix_survives_pressure(daemon_factory):
    d = daemon_factory(["--host-capacity", "8MiB", "--slab-bytes", "1MiB"],
                       env={"TIERKV_HOST_MAX_PINNED_FRACTION": "0.15"})
    with d.client(layout=BIG) as c:
        sys_keys = keys_for(c, 8, seed=2)
        c.put(sys_keys, rand_blocks(8, BIG, seed=2))
        assert c.pin_prefix(sys_keys, priority=90) == 8
        for i in range(6):  # 3x the host tier of other traffic
            k = keys_for(c, 32, seed=100 + i)
            c.put(k, rand_blocks(32, BIG, seed=100 + i))
        assert c.lookup_tiers(sys_keys) == ["host"] * 8
        assert c.stats()["tiers"]["host"]["pinned_bytes"] == 8 * BIG.block_bytes
        more = keys_for(c, 16, seed=300)
        c.put(more, rand_blocks(16, BIG, seed=300))
        with pytest.raises(TierFull):
            c.pin_prefix(more, priority=50)  # 1.5 MiB pinned would be over 15% of the 8 MiB host tier
        with pytest.raises(BadRequest):
            c.pin_prefix(sys_keys, priority=0)
        assert c.unpin(sys_keys) == 8
        assert c.stats()["tiers"]["host"]["pinned_bytes"] == 0


def test_preload_cli(daemon, tmp_path):
    from tierkv.ops.preload import export_prefix

    tokens = np.arange(16 * 5)
    with daemon.client() as c:
        keys = c.block_keys(tokens)
        c.put(keys, rand_blocks(5, seed=3))
        assert export_prefix(c, tokens, tmp_path / "sys.npz") == 5
        c.delete(keys)
        assert c.lookup(keys) == 0
    r = CliRunner().invoke(main, ["preload", str(tmp_path / "sys.npz"), "--socket", daemon.socket, "--priority", "70"])
    assert r.exit_code == 0 and "pinned 5 blocks" in r.output, r.output
    with daemon.client() as c:
        assert torch.equal(c.get(keys).view(torch.int16), rand_blocks(5, seed=3).view(torch.int16))
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    r = CliRunner().invoke(main, ["preload", str(tmp_path / "bad.npz"), "--socket", daemon.socket])
    assert r.exit_code != 0 and "not a tierkv prefix file" in r.output


def test_window_demotes_middle_by_attention(daemon):
    with daemon.client() as c:
        keys = keys_for(c, 12, seed=4)
        blocks = rand_blocks(12, seed=4)
        c.put(keys, blocks)
        mass = [5.0] + [0.1] * 10 + [1.0]
        mass[6] = 9.0  # one hot block in the middle
        c.touch(keys, mass)
        assert c.set_window(keys, budget=5, sinks=1, recent=3) == 7
        tiers = c.lookup_tiers(keys)
        assert [i for i, t in enumerate(tiers) if t == "host"] == [0, 6, 9, 10, 11]
        assert tiers.count("disk") == 7  # demoted, never dropped
        assert torch.equal(c.get(keys).view(torch.int16), blocks.view(torch.int16))


def test_disk_admission_reused_only(daemon_factory):
    d = daemon_factory(["--host-capacity", "4MiB", "--slab-bytes", "1MiB"], env={"TIERKV_DISK_ADMISSION": "reused"})
    with d.client(layout=BIG) as c:
        hot = keys_for(c, 4, seed=5)
        c.put(hot, rand_blocks(4, BIG, seed=5))
        c.get(hot)  # used twice: admitted to disk when demoted
        for i in range(4):
            c.put(keys_for(c, 16, seed=200 + i), rand_blocks(16, BIG, seed=200 + i))  # one-shot
        time.sleep(1.0)
        st = c.stats()["tiers"]["disk"]
        assert st["rejected"] > 0
        assert c.lookup(hot) == 4


def test_codec_switch_at_run_time_keeps_old_blocks_readable(daemon):
    with daemon.client() as c:
        old = keys_for(c, 4, seed=6)
        c.put(old, rand_blocks(4, seed=6), durable=True)  # lossless on disk
        r = CliRunner().invoke(main, ["tune", "--socket", daemon.socket, "disk.codec=int8"])
        assert r.exit_code == 0, r.output
        new = keys_for(c, 4, seed=7)
        c.put(new, rand_blocks(4, seed=7), durable=True)  # int8 on disk
        assert c.stats()["tiers"]["disk"]["codec"] == "int8"
    daemon.restart()  # everything now comes from disk
    with daemon.client() as c:
        assert c.lookup_tiers(old + new) == ["disk"] * 8
        assert torch.equal(c.get(old).view(torch.int16), rand_blocks(4, seed=6).view(torch.int16))  # exact
        got = c.get(new).float()
        want = rand_blocks(4, seed=7).float()
        assert not torch.equal(got, want)  # int8 is lossy...
        assert ((got - want).norm() / want.norm()) < 0.02  # ...within its bound

"""Eviction and admission across the stack, in a running daemon and in `tierkv replay`: demotion to disk,
the engine's request-finished signal, learned classes across restarts, and `tierkv replay --policy
default` running what configs/default.toml sets."""

from __future__ import annotations

import json
import time
import tomllib

import pytest
import torch
from click.testing import CliRunner

import tierkv
from tests.helpers import PAGE, REPO, SMALL, RawClient, keys_for, line, rand_blocks, settled_stats, wait_for
from tierkv.core import protocol
from tierkv.core.errors import BadRequest
from tierkv.core.keys import Namespace
from tierkv.core.protocol import Op
from tierkv.daemon.config import Config
from tierkv.ops.replay_cli import replay as replay_cmd
from tierkv.sim.replay import ReplayConfig, TierSpec, Workload, parse_trace, replay

MIB_LAYOUT = tierkv.Layout(8, 8, 128, 32, "bfloat16")  # 1 MiB blocks


# -- the daemon ----------------------------------------------------------------------------------

def test_store_overflow_reaches_disk_so_every_block_is_found(daemon_factory):
    """96 blocks through a 64 MiB host tier with a 16 GiB disk: the overflow is written (the writer
    keeps up), so lookup finds every block, and each reads back exactly."""
    d = daemon_factory(["--host-capacity", "64MiB", "--disk-capacity", "16GiB", "--slab-bytes", "8MiB"])
    with d.client(layout=MIB_LAYOUT) as c:
        keys, blocks = keys_for(c, 96, seed=14), rand_blocks(96, MIB_LAYOUT, seed=14)
        for i in range(0, 96, 8):
            c.put(keys[i:i + 8], blocks[i:i + 8])
        assert c.lookup(keys) == 96
        st = c.stats()["tiers"]
        assert st["disk"]["admission"] == "predicted" and st["disk"]["rejected"] == 0
        for i in range(0, 96, 24):
            assert torch.equal(c.get(keys[i:i + 24]).view(torch.int16), blocks[i:i + 24].view(torch.int16))


def test_the_disk_shadow_sees_the_disk_references_of_a_running_daemon(daemon_factory):
    """The disk order's shadow is fed by the blocks requests use that host memory does not hold (a
    fetch of a prefix on disk, a store of new blocks) and shows in the stats."""
    d = daemon_factory(["--host-capacity", "1MiB", "--slab-bytes", "1MiB", "--disk-capacity", "8MiB"],
                       env={"TIERKV_DISK_ADMISSION": "all", "TIERKV_DISK_ORDER_SHADOW_RATE": "1.0"})
    with d.client() as c:  # 8 KiB blocks: 128 host slots
        chains = [keys_for(c, 24, seed=400 + i) for i in range(8)]
        for i, keys in enumerate(chains):
            c.put(keys, rand_blocks(24, seed=400 + i))
        assert wait_for(lambda: c.stats()["tiers"]["disk"]["blocks"] > 0, timeout=30)
        shadow = c.stats()["tiers"]["disk"]["shadow"]
        assert shadow["rate"] == 1.0 and shadow["references"] == 8 * 24  # every stored block, once
        for keys in chains:  # host memory holds 128 of the 192 blocks: the others are read from disk, a
            c.get(keys)      # disk reference each (hits for both orders), whichever ones the evictor chose
        after = c.stats()["tiers"]["disk"]["shadow"]
        assert after["references"] > shadow["references"] and after["leader"] in ("attention", "lru")


def test_disk_evicts_chains_from_the_tail(daemon_factory):
    """The disk tier knows each block's chain: when it fills, stored chains lose their tails first, so
    every chain keeps a cached prefix (a block whose prefix is gone can never be a hit)."""
    d = daemon_factory(["--host-capacity", "1MiB", "--slab-bytes", "1MiB", "--disk-capacity", "2MiB"],
                       env={"TIERKV_DISK_ADMISSION": "all"})  # every host victim is written
    with d.client() as c:  # 8 KiB blocks: 128 host slots, about 240 blocks on disk
        chains = [keys_for(c, 24, seed=100 + i) for i in range(14)]
        for i, keys in enumerate(chains):
            c.put(keys, rand_blocks(24, seed=100 + i))
            if i < 7:
                c.get(keys)  # a use of the whole chain: deeper blocks cost more to recompute
        assert wait_for(lambda: c.stats()["tiers"]["disk"]["evictions"] > 0, timeout=30)
        for keys in chains:
            held = [c.lookup([k]) for k in keys]
            assert held == sorted(held, reverse=True), f"a chain lost a block before its tail: {held}"


def test_request_finished_reaches_the_placement_rule(daemon):
    with daemon.client() as c:
        keys = keys_for(c, 6, seed=15)
        c.put(keys[:4], rand_blocks(4, seed=15))
        assert c.request_finished(keys) == 4  # two keys are not cached (an output not stored yet)
        place = c.stats()["tiers"]["disk"]["placement"]
        assert place["mode"] == "predicted" and place["finished_requests"] == 1
        assert place["floor"]["ghost"] >= 0 and "classes" in place["floor"]  # the admission floor's model
        assert place["shadow"]["leader"] == "predicted" and place["shadow"]["rate"] == 0.1  # disk.shadow_rate
        with pytest.raises(BadRequest):
            c.request_finished([b""])
        assert c.request_finished([]) == 0


def test_request_finished_carries_the_generated_token_count(daemon):
    with daemon.client() as c:
        keys = keys_for(c, 4, seed=19)
        c.put(keys, rand_blocks(4, seed=19))
        assert c.request_finished(keys, output_tokens=12) == 4
        assert c.request_finished(keys) == 4  # the count is optional
        for st in (c.stats()["tiers"]["disk"]["placement"], c.stats()["tiers"]["host"]["reuse"]):
            assert st["finished_requests"] == 2 and st["finished_with_output_tokens"] == 1
        for bad in (-1, 1.5, True, "12"):
            with pytest.raises(ValueError):
                c.request_finished(keys, output_tokens=bad)
    rc = RawClient(daemon.socket)
    try:
        assert rc.hello(Namespace("tierkv-test", SMALL))[0] == protocol.STATUS_OK
        for bad in (-1, 1.5, True, "12", [3]):
            status, reply = rc.call(Op.REQUEST_FINISHED, {"keys": [b"k" * 8], "output_tokens": bad})
            assert status != protocol.STATUS_OK and "output_tokens" in str(reply)
        assert rc.ok(Op.REQUEST_FINISHED, {"keys": [b"k" * 8], "output_tokens": 0})["cached"] == 0
    finally:
        rc.close()
    with daemon.client() as c:  # nothing stored was touched by the bad requests
        assert c.lookup(keys) == 4


def test_learned_classes_survive_a_restart(daemon_factory):
    """The reuse models' class counts are kept in the data directory: a restarted daemon starts with
    what the last one learned; a damaged file is ignored and nothing stored is lost."""
    d = daemon_factory(["--host-capacity", "4MiB", "--slab-bytes", "1MiB"])
    with d.client() as c:  # 8 KiB blocks: 512 host slots; the first blocks leave host, then return
        keys = keys_for(c, 700, seed=20)
        for i in range(0, 700, 50):
            c.put(keys[i:i + 50], rand_blocks(50, seed=20 + i))
        c.request_finished(keys[:100], output_tokens=7)
        c.get(keys[:60])
        before = settled_stats(c)["tiers"]  # the evictor goes on after the get: each eviction teaches
    learned = (before["host"]["reuse"]["classes"], before["disk"]["placement"]["classes"],
               before["disk"]["placement"]["eviction"]["classes"])
    assert learned[0] and not before["host"]["reuse"]["restored_counts"]
    d.restart()
    with d.client() as c:
        st = c.stats()["tiers"]
        place = st["disk"]["placement"]
        assert (st["host"]["reuse"]["classes"], place["classes"], place["eviction"]["classes"]) == learned
        assert st["host"]["reuse"]["restored_counts"] and place["restored_counts"]
        assert place["eviction"]["restored_counts"]
        held = c.lookup(keys)
    d.stop()
    (d.workdir / "data" / "reuse-classes.msgpack").write_bytes(b"\xc1 not msgpack")
    d.start()
    with d.client() as c:
        st = c.stats()["tiers"]
        assert not st["host"]["reuse"]["restored_counts"] and st["host"]["reuse"]["classes"] == {}
        assert c.lookup(keys) == held


def test_durable_puts_are_written_whatever_the_rule(daemon_factory):
    d = daemon_factory(env={"TIERKV_DISK_ADMISSION": "pinned"})
    with d.client() as c:
        keys = keys_for(c, 8, seed=16)
        c.put(keys, rand_blocks(8, seed=16), durable=True)
        assert c.lookup_tiers(keys) == ["host"] * 8
    d.restart()
    with d.client() as c:
        assert c.lookup_tiers(keys) == ["disk"] * 8


def test_host_stats_show_the_learned_reuse(daemon_factory):
    d = daemon_factory(["--host-capacity", "4MiB", "--slab-bytes", "1MiB"])
    with d.client() as c:  # 8 KiB blocks: 512 slots
        keys = keys_for(c, 700, seed=18)
        for i in range(0, 700, 50):
            c.put(keys[i:i + 50], rand_blocks(50, seed=18 + i))
        c.get(keys[-10:])
        reuse = c.stats()["tiers"]["host"]["reuse"]
        assert reuse["ghost"] > 0 and set(reuse) >= {"returns", "classes", "finished_requests"}


# -- the simulator -------------------------------------------------------------------------------

def test_replay_predicted_keeps_the_next_turn():
    """A conversation whose turns arrive after the host has evicted the previous one: the reused
    rule drops the once-used turn, the predicted rule writes it and the next turn hits on disk."""
    lines, t = [], 0
    for turn in range(1, 6):
        lines.append(line(t, 512 * turn, list(range(turn))))
        lines.append(line(t + 100, 512, [1000 + turn]))  # another user's one-shot prompt evicts it
        t += 1000
    w = Workload(parse_trace(lines))

    def run(mode):
        tiers = [TierSpec("host", PAGE), TierSpec("disk", 50 * PAGE, admission=mode, inclusive=True)]
        return replay(w, "lru", ReplayConfig(tiers=tiers, kv_bytes_per_token=1))

    old, new = run("reused"), run("predicted")
    assert new.token_hit_rate > old.token_hit_rate
    assert new.tier_hit_rate["disk"] == pytest.approx(new.token_hit_rate)
    assert (new.admission, old.admission) == ("predicted", "reused")


def test_replay_policy_default_runs_configs_default_toml(tmp_path):
    with open(REPO / "configs" / "default.toml", "rb") as fh:
        toml = tomllib.load(fh)
    cfg = Config()
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(line(i * 1000, 1024, [i % 5, 100 + i]) for i in range(40)) + "\n")
    res = CliRunner().invoke(replay_cmd, [str(path), "--policy", "default", "--capacity", "10%",
                                          "--disk-capacity", "50%", "--kv-bytes-per-token", "1", "--json"])
    assert res.exit_code == 0, res.output
    row = next(r for r in json.loads(res.output) if r["policy"] == "default")
    assert row["placement"] == f"host={toml['host']['policy']},disk={toml['disk']['policy']}"
    assert row["admission"] == toml["disk"]["admission"] == cfg.disk.admission
    for key in ("token_hit_rate", "disk_writes_bytes", "tier_hit_rate", "ttft_p50_s"):
        assert key in row


def test_replay_default_ages_the_disk_as_the_daemon_does():
    """``--policy default`` gives the disk policy ``disk.idle_aging`` and leaves the host on the GDSF
    clock, as the daemon does; other policy names run without it."""
    import dataclasses

    from tierkv.ops.replay_cli import daemon_config, tiers_for
    from tierkv.sim.simulator import Simulator

    w = Workload(parse_trace([line(i * 1000, 1024, [i % 5, 100 + i]) for i in range(40)]))
    tiers = [TierSpec("host", "10%"), TierSpec("disk", "30%", inclusive=True)]
    daemon = daemon_config(None)
    daemon = dataclasses.replace(daemon, disk=dataclasses.replace(daemon.disk, idle_aging=1.25))
    sim = Simulator(w, "default", tiers_for("default", ReplayConfig(tiers=tiers), daemon, "all"))
    assert [p.settings()["idle_aging"] for p in sim.policies] == [0.0, 1.25]
    sim = Simulator(w, "attention", tiers_for("attention", ReplayConfig(tiers=tiers), daemon, "all"))
    assert [p.settings()["idle_aging"] for p in sim.policies] == [0.0, 0.0]


def test_replay_reads_the_repository_default_toml(tmp_path, monkeypatch):
    """``--policy default`` without ``--config`` reads configs/default.toml itself, not the built-in
    defaults: a setting changed there reaches the replay."""
    from tierkv.ops import replay_cli

    assert replay_cli.DEFAULT_CONFIG.resolve() == (REPO / "configs" / "default.toml").resolve()  # one file
    assert replay_cli.DEFAULT_CONFIG.is_file()
    text = replay_cli.DEFAULT_CONFIG.read_text().replace('admission = "predicted"', 'admission = "reused"')
    (tmp_path / "default.toml").write_text(text)
    monkeypatch.setattr(replay_cli, "DEFAULT_CONFIG", tmp_path / "default.toml")
    assert replay_cli.daemon_config(None).disk.admission == "reused"


def test_store_burst_under_the_default_evicts_clean_blocks(daemon_factory):
    """Write-behind under the default rule: blocks are written while the disk is idle, so a burst
    past the host capacity evicts clean blocks and never waits for a write. Write-behind runs whatever
    the other processes' load (``host.write_behind_idle_cores = 0``, no ``disk.background_share``): the
    machine's other work (the suite's other worker) is not an engine this daemon serves; how it gives way
    to a busy engine is tests/daemon/test_transfer_daemon.py's."""
    d = daemon_factory(["--host-capacity", "8MiB", "--slab-bytes", "1MiB"],
                       env={"TIERKV_HOST_WRITE_BEHIND_IDLE_CORES": "0", "TIERKV_DISK_BACKGROUND_SHARE": "0"})
    with d.client() as c:  # 8 KiB blocks: 1,024 host slots
        keys, blocks = keys_for(c, 1400, seed=17), rand_blocks(1400, seed=17)
        c.put(keys[:800], blocks[:800])
        deadline = time.time() + 30
        while time.time() < deadline and c.stats()["tiers"]["disk"]["blocks"] < 700:
            time.sleep(0.05)
        assert c.stats()["tiers"]["disk"]["written_behind"] >= 700
        t0 = time.perf_counter()
        c.put(keys[800:], blocks[800:])
        burst_s = time.perf_counter() - t0
        st = c.stats()["tiers"]
        assert st["host"]["evictions"] >= 400 - 224 and st["disk"]["admission"] == "predicted"
        assert c.lookup(keys) == 1400
        assert burst_s < 5.0, burst_s


def test_replay_advise_recommends_an_admission_setting(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(line(i * 1000, 1024, [i % 5, 100 + i]) for i in range(40)) + "\n")
    res = CliRunner().invoke(replay_cmd, [str(path), "--advise", "--json", "--kv-bytes-per-token", "1"])
    assert res.exit_code == 0, res.output
    rec = json.loads(res.output)["recommended"]
    assert rec["admission"] in ("predicted", "reused", "all")
    assert set(rec["admission_runs"]) == {"predicted", "reused", "all"}
    assert rec["opt"]["token_hit_rate"] >= max(r["token_hit_rate"] for r in rec["admission_runs"].values()) - 1e-9
    res = CliRunner().invoke(replay_cmd, [str(path), "--advise", "--kv-bytes-per-token", "1"])
    assert "disk.admission" in res.output


def test_chat_trace_is_deterministic_and_multi_turn():
    from tierkv.sim.chat_trace import ChatTraceSpec, generate

    spec = ChatTraceSpec(conversations=30, seed=3)
    a, b = generate(spec), generate(spec)
    assert a == b and a != generate(ChatTraceSpec(conversations=30, seed=4))
    ts = [r["timestamp"] for r in a]
    assert ts == sorted(ts)
    w = Workload(parse_trace(json.dumps(r) for r in a))
    # a later turn of a conversation starts with the earlier turn's full blocks
    conv = [r["hash_ids"] for r in a if r["hash_ids"][-1].startswith("c0.")]
    assert len(conv) >= 2 and conv[1][:len(conv[0]) - 1] == conv[0][:-1]
    assert w.unique_pages < sum(len(p) for p in w.pages)
    with pytest.raises(ValueError):
        ChatTraceSpec(user_tokens=(5, 1))


def test_admission_mode_tunes_at_run_time(daemon):
    from tierkv.ops.cli import main

    r = CliRunner().invoke(main, ["tune", "--socket", daemon.socket, "disk.admission=reused"])
    assert r.exit_code == 0, r.output
    disk = daemon.stats()["tiers"]["disk"]
    assert disk["admission"] == "reused" and disk["placement"]["mode"] == "reused"
    r = CliRunner().invoke(main, ["tune", "--socket", daemon.socket, "disk.admission=sometimes"])
    assert r.exit_code != 0
    assert daemon.stats()["tiers"]["disk"]["placement"]["mode"] == "reused"

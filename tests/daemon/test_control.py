"""The control API of a real daemon over HTTP: pin, unpin, warm and delete a prefix given as token ids,
status, the bearer token, and bad requests that change nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from tests.daemon.test_metrics import free_port
from tests.helpers import REPO, SMALL, rand_blocks
from tierkv.core.keys import chain_keys, salt_root

BT = SMALL.block_tokens
TOKEN = "s3cret-token-for-the-tests"


def _call(port: int, method: str, op: str, body: dict | None = None, token: str | None = TOKEN) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/{op}", method=method,
                                 data=None if body is None else json.dumps(body).encode())
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def control(daemon_factory, tmp_path):
    """A daemon with a 1 MiB host tier (128 blocks) under LRU over an 8 MiB disk, its control API on a free port."""
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    port = free_port()
    d = daemon_factory(["--metrics-addr", f"127.0.0.1:{port}", "--control-token-file", str(token),
                        "--host-capacity", "1MiB", "--slab-bytes", "1MiB", "--disk-capacity", "8MiB", "--policy", "lru"])
    d.port = port
    return d


def _prompt(seed: int, blocks: int) -> list[int]:
    return [seed * 10_000 + i for i in range(blocks * BT)]


def _flood(c, blocks: int, seed: int = 50) -> None:
    for i in range(blocks // 8):
        c.put(c.block_keys(_prompt(seed + i, 8)), rand_blocks(8, seed=seed + i), durable=True)


def test_changes_need_the_bearer_token_and_status_is_open(control):
    port = control.port
    with control.client(model="ctl-a"):
        status, body = _call(port, "GET", "status", token=None)
        assert status == 200 and body["health"] == "ok"
        assert [ns["model"] for ns in body["namespaces"]] == ["ctl-a"]
        req = {"model": "ctl-a", "tokens": _prompt(1, 2)}
        assert _call(port, "POST", "pin", req, token=None)[0] == 401
        assert _call(port, "POST", "pin", req, token="wrong-token-of-some-length")[0] == 403
        assert _call(port, "POST", "pin", req)[0] == 200


def test_a_pinned_prefix_outlives_a_flood_and_an_unpinned_one_does_not(control):
    port = control.port
    with control.client(model="ctl-a") as c:
        tokens = _prompt(1, 4)
        keys = c.block_keys(tokens)
        c.put(keys, rand_blocks(4, seed=1))
        assert _call(port, "POST", "pin", {"model": "ctl-a", "tokens": tokens}) == (200, {"pinned": 4, "missing": 0})
        assert _call(port, "GET", "status")[1]["pins"]["blocks"] == 4
        _flood(c, 512)  # 4x the host tier
        assert c.lookup_tiers(keys) == ["host"] * 4, "a pin keeps every block in host memory"
        assert _call(port, "POST", "unpin", {"model": "ctl-a", "tokens": tokens}) == (200, {"unpinned": 4})
        _flood(c, 512, seed=200)
        assert "host" not in c.lookup_tiers(keys), "unpinned, the flood evicts it"


def test_warm_brings_a_prefix_back_from_disk_and_says_what_was_missing(control):
    port = control.port
    with control.client(model="ctl-a") as c:
        tokens = _prompt(2, 4)
        keys = c.block_keys(tokens)
        c.put(keys, rand_blocks(4, seed=2), durable=True)
        _flood(c, 512)
        assert c.lookup_tiers(keys) == ["disk"] * 4
        status, body = _call(port, "POST", "warm", {"model": "ctl-a", "tokens": tokens + _prompt(3, 2)})
        assert status == 200 and body["warmed"] == 4 and body["from"] == {"disk": 4} and body["missing"] == 2
        assert body["bytes"] == 4 * SMALL.block_bytes
        assert c.lookup_tiers(keys) == ["host"] * 4
        got = c.get(keys)
        assert got.shape[0] == 4


def test_delete_by_prefix_spares_pins_unless_forced_and_other_tenants(control):
    port = control.port
    with control.client(model="ctl-a") as c:
        fp = c.fingerprint
        tokens = _prompt(4, 3)
        shared, salted = chain_keys(fp, tokens, BT), chain_keys(fp, tokens, BT, salt_root(fp, "tenant-b"))
        assert shared == c.block_keys(tokens)
        c.put(shared, rand_blocks(3, seed=4))
        c.put(salted, rand_blocks(3, seed=5))
        req = {"model": "ctl-a", "tokens": tokens, "salt": "tenant-b"}
        assert _call(port, "POST", "pin", req)[1]["pinned"] == 3
        assert _call(port, "POST", "delete", req) == (200, {"deleted": 0}), "pinned blocks stay without force"
        assert _call(port, "POST", "delete", {**req, "force": True}) == (200, {"deleted": 3})
        assert c.lookup(salted) == 0 and c.lookup(shared) == 3, "another tenant's prefix is untouched"
        assert _call(port, "POST", "delete", {"model": "ctl-a", "tokens": tokens}) == (200, {"deleted": 3})
        assert c.lookup(shared) == 0


def test_bad_requests_get_one_clear_error_and_change_nothing(control):
    port = control.port
    with control.client(model="ctl-a") as c:
        tokens = _prompt(6, 2)
        keys = c.block_keys(tokens)
        c.put(keys, rand_blocks(2, seed=6))
        for body, needle in (({"tokens": tokens}, "model is required"),
                             ({"model": "nope", "tokens": tokens}, "no engine has registered model 'nope'"),
                             ({"model": "ctl-a", "tokens": [1, "x"]}, "tokens must be token ids"),
                             ({"model": "ctl-a", "tokens": []}, "tokens must be a list"),
                             ({"model": "ctl-a", "tokens": tokens[:BT - 1]}, "less than one block"),
                             ({"model": "ctl-a", "tokens": tokens, "salt": 3}, "salt must be"),
                             ({"model": "ctl-a", "tokens": tokens, "priority": 0}, "priority must be")):
            status, reply = _call(port, "POST", "pin", body)
            assert status == 400 and needle in reply["error"], (body, reply)
        assert _call(port, "POST", "nothing", {})[0] == 404
        big = _prompt(7, 80)  # more than host.max_pinned_fraction (half) of the 128-block tier
        c.put(c.block_keys(big)[:72], rand_blocks(72, seed=7))
        status, reply = _call(port, "POST", "pin", {"model": "ctl-a", "tokens": big})
        assert status == 409 and "bytes would exceed host.max_pinned_fraction" in reply["error"]
        assert _call(port, "GET", "status")[1]["pins"]["blocks"] == 0, "a refused pin pins nothing"
        assert c.lookup(keys) == 2


def test_a_token_file_others_can_read_stops_the_start(tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o644)
    proc = subprocess.run([sys.executable, "-m", "tierkv", "serve", "--socket", str(tmp_path / "s.sock"),
                           "--data-dir", str(tmp_path / "d"), "--metrics-addr", str(free_port()),
                           "--control-token-file", str(token), "--host-capacity", "4MiB"],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env={**os.environ})
    assert proc.returncode != 0 and "readable by others" in proc.stderr


def test_the_python_client_and_the_cli_do_the_same_operations(control, tmp_path):
    from tierkv.client.control_api import ControlClient
    from tierkv.core.errors import BadRequest, PermissionDenied, TierFull

    token = tmp_path / "token"  # the fixture's
    ctl = ControlClient(f"127.0.0.1:{control.port}", token_file=str(token))
    with control.client(model="ctl-a") as c:
        tokens = _prompt(8, 2)
        c.put(c.block_keys(tokens), rand_blocks(2, seed=8))
        assert ctl.status()["namespaces"][0]["blocks"] == 2
        assert ctl.pin("ctl-a", tokens) == {"pinned": 2, "missing": 0}
        with pytest.raises(PermissionDenied, match="Bearer"):
            ControlClient(f"127.0.0.1:{control.port}").unpin("ctl-a", tokens)
        with pytest.raises(BadRequest, match="no engine has registered model 'other'"):
            ctl.warm("other", tokens)
        big = _prompt(9, 80)
        c.put(c.block_keys(big)[:72], rand_blocks(72, seed=9))
        with pytest.raises(TierFull, match="max_pinned_fraction"):
            ctl.pin("ctl-a", big)

        def cli(*args: str) -> dict:
            out = subprocess.run([sys.executable, "-m", "tierkv", "control", *args, "--addr", str(control.port),
                                  "--token-file", str(token)], capture_output=True, text=True, timeout=60, cwd=REPO)
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)

        ids = ",".join(map(str, tokens))
        assert cli("quotas", "--tenant", "t1", "--host", "64KiB")["quota"] == {"host": 65536, "disk": None}
        assert ctl.set_quota("t1", host=None, disk=1 << 20)["quota"] == {"host": None, "disk": 1 << 20}
        assert cli("tenants")["tenants"]["t1"]["quota"] == {"host": None, "disk": 1 << 20}
        assert cli("unpin", ids, "--model", "ctl-a") == {"unpinned": 2}
        assert cli("delete", ids, "--model", "ctl-a") == {"deleted": 2}
        assert cli("status")["pins"] == {"blocks": 0, "bytes": 0, "disk_blocks": 0, "disk_bytes": 0}
        bad = subprocess.run([sys.executable, "-m", "tierkv", "control", "pin", "1,x", "--model", "ctl-a",
                              "--addr", str(control.port), "--token-file", str(token)],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "tokens" in bad.stderr


def test_delete_takes_the_copies_of_the_tiers_named_or_a_whole_namespace(control):
    port = control.port
    with control.client(model="ctl-a") as c, control.client(model="ctl-b") as other:
        tokens = _prompt(10, 4)
        keys = c.block_keys(tokens)
        c.put(keys, rand_blocks(4, seed=10), durable=True)
        assert c.lookup_tiers(keys) == ["host"] * 4
        assert _call(port, "POST", "delete", {"model": "ctl-a", "tokens": tokens, "tiers": ["host"]}) == \
            (200, {"deleted": 4})
        assert c.lookup_tiers(keys) == ["disk"] * 4, "the disk copies stay"
        more = c.block_keys(_prompt(11, 3))
        c.put(more, rand_blocks(3, seed=11))
        theirs = other.block_keys(tokens)
        other.put(theirs, rand_blocks(4, seed=12))
        assert _call(port, "POST", "delete", {"model": "ctl-a", "tiers": ["tape"]})[0] == 400
        assert _call(port, "POST", "delete", {"model": "ctl-a"}) == (200, {"deleted": 7})
        assert c.lookup(keys) == 0 and c.lookup(more) == 0
        assert other.lookup(theirs) == 4, "another model's namespace is untouched"
        assert _call(port, "GET", "status")[1]["namespaces"][0]["blocks"] in (0, 4)


def _flood_as(c, tenant: str, blocks: int, seed: int) -> None:
    for i in range(blocks // 8):
        c.put(c.block_keys(_prompt(seed + i, 8)), rand_blocks(8, seed=seed + i), durable=True, tenant=tenant)


@pytest.mark.parametrize("quota", [True, False])
def test_a_tenant_under_its_quota_keeps_its_blocks_through_another_tenants_flood(control, quota):
    port = control.port
    with control.client(model="ctl-a") as c:
        if quota:
            assert _call(port, "POST", "quotas", {"tenant": "a", "host": 32 * 8192})[0] == 200
        tokens = _prompt(20, 16)
        keys = c.block_keys(tokens)
        c.put(keys, rand_blocks(16, seed=20), tenant="a")
        assert c.lookup(keys) == 16
        _flood_as(c, "b", 512, seed=300)  # 4x the host tier
        tiers = c.lookup_tiers(keys)
        if quota:
            assert tiers == ["host"] * 16, "the flood evicts none of a's blocks"
        else:
            assert "host" not in tiers, "without a quota the flood evicts a's blocks"
        used = _call(port, "GET", "tenants")[1]["tenants"]
        assert list(used) == (["a"] if quota else []), "only tenants with a quota are accounted"
        if quota:
            from tests.daemon.test_metrics import scrape
            assert used["a"]["used"]["host"] == 16 * 8192
            m = scrape(port)
            assert m[("tierkv_tenant_used_bytes", (("tenant", "a"), ("tier", "host")))] == 16 * 8192
            assert m[("tierkv_tenant_quota_bytes", (("tenant", "a"), ("tier", "host")))] == 32 * 8192
        assert c.get(keys).shape[0] == 16


def test_a_tenant_over_its_quota_gives_up_its_own_blocks(control):
    from tests.helpers import wait_for

    port = control.port
    with control.client(model="ctl-a") as c:
        keep = c.block_keys(_prompt(21, 8))
        c.put(keep, rand_blocks(8, seed=21))  # no tenant: shares what remains
        assert _call(port, "POST", "quotas", {"tenant": "b", "host": 16 * 8192, "disk": None})[1]["quota"] == \
            {"host": 16 * 8192, "disk": None}
        _flood_as(c, "b", 64, seed=400)

        def b_host() -> int:
            return _call(port, "GET", "tenants")[1]["tenants"]["b"]["used"]["host"]
        assert wait_for(lambda: b_host() <= 16 * 8192), b_host()
        assert c.lookup_tiers(keep) == ["host"] * 8, "the host tier had room: nothing else was evicted"
        assert c.lookup(c.block_keys(_prompt(400, 8))) == 8, "b's blocks went to disk, not away"
        late = c.block_keys(_prompt(22, 4))
        c.put(late, rand_blocks(4, seed=22), tenant="late")
        assert "late" not in _call(port, "GET", "tenants")[1]["tenants"]
        got = _call(port, "POST", "quotas", {"tenant": "late", "host": 1 << 20})[1]
        assert got["used"]["host"] == 4 * 8192, "a first quota counts what its tenant holds already"
        assert _call(port, "POST", "quotas", {"tenant": "late", "host": None})[1]["quota"]["host"] is None
        assert "late" not in _call(port, "GET", "tenants")[1]["tenants"]
        for body, needle in (({"host": 1}, "tenant must be"), ({"tenant": "b", "host": -1}, "bytes >= 0"),
                             ({"tenant": "b", "tape": 1}, "host and/or disk"), ({"tenant": "b"}, "host and/or disk")):
            status, reply = _call(port, "POST", "quotas", body)
            assert status == 400 and needle in reply["error"], (body, reply)
        assert _call(port, "POST", "quotas", {"tenant": "b", "host": 1}, token=None)[0] == 401


def test_a_pinned_prefix_is_pinned_in_host_memory_again_after_a_restart(control):
    """The pin makes the blocks durable and is kept in the data directory: after a restart the prefix is
    loaded into host memory and pinned before any engine connects (the control API knows its model),
    and outlives a flood again."""
    from tests.helpers import wait_for

    port = control.port
    tokens = _prompt(30, 4)
    with control.client(model="ctl-a") as c:
        keys = c.block_keys(tokens)
        c.put(keys, rand_blocks(4, seed=30))
        assert _call(port, "POST", "pin", {"model": "ctl-a", "tokens": tokens, "priority": 90})[1]["pinned"] == 4
        assert wait_for(lambda: c.stats()["tiers"]["disk"]["blocks"] >= 4), "a pin writes its blocks to disk"
        _flood(c, 1024, seed=700)  # more than the disk holds too: the pinned values stay there
        assert c.stats()["tiers"]["disk"]["evictions"] > 0
    control.restart()
    status = _call(port, "GET", "status")[1]
    assert [ns["model"] for ns in status["namespaces"]] == ["ctl-a"] and status["pins"]["blocks"] == 4
    with control.client(model="ctl-a") as c:
        assert c.lookup_tiers(keys) == ["host"] * 4
        _flood(c, 512, seed=600)
        assert c.lookup_tiers(keys) == ["host"] * 4
        assert _call(port, "POST", "unpin", {"model": "ctl-a", "tokens": tokens}) == (200, {"unpinned": 4})
    control.restart()
    assert _call(port, "GET", "status")[1]["pins"]["blocks"] == 0, "an unpin is kept too"


def test_a_pin_whose_disk_write_was_refused_is_written_at_shutdown_and_pinned_again(control):
    """A pin's blocks go to disk so a restart pins them again. Where the disk could not take them then
    (full of a tenant's blocks its quota shields), a graceful stop writes them once it can, even with
    the shutdown flush of every other dirty block off."""
    from tests.helpers import wait_for
    from tierkv.core.errors import TierKVError

    control.stop()
    control.env["TIERKV_SERVER_FLUSH_ON_SHUTDOWN"] = "false"
    control.start()
    port = control.port
    tokens = _prompt(40, 32)
    with control.client(model="ctl-a") as c:
        _call(port, "POST", "quotas", {"tenant": "t", "disk": 64 << 20})  # more than the disk: always shielded
        for i in range(32):  # 8 MiB of t's values: the disk is full of blocks no other tenant may evict
            try:
                c.put(c.block_keys(_prompt(900 + i, 32)), rand_blocks(32, seed=i), durable=True, tenant="t")
            except TierKVError:
                break
        keys = c.block_keys(tokens)
        c.put(keys, rand_blocks(32, seed=40))  # more than the room left under the disk's high watermark
        refused = c.stats()["tiers"]["disk"]["errors"]
        assert _call(port, "POST", "pin", {"model": "ctl-a", "tokens": tokens})[1]["pinned"] == 32
        assert wait_for(lambda: c.stats()["tiers"]["disk"]["errors"] > refused), "the pin's write is refused"
        _call(port, "POST", "quotas", {"tenant": "t", "disk": None})  # t's values may go now
    control.restart()
    assert _call(port, "GET", "status")[1]["pins"]["blocks"] == 32
    with control.client(model="ctl-a") as c:
        assert c.lookup_tiers(keys) == ["host"] * 32


def test_pins_are_counted_and_a_pin_on_disk_keeps_the_values_there_across_a_restart(control):
    """Two pins of a prefix need two unpins; a pin on disk writes what host memory holds only, keeps the
    values through a flood of the disk and a restart, and lets the host copies go."""
    port = control.port
    host_tokens, disk_tokens = _prompt(60, 4), _prompt(61, 6)
    with control.client(model="ctl-a") as c:
        hkeys, dkeys = c.block_keys(host_tokens), c.block_keys(disk_tokens)
        c.put(hkeys, rand_blocks(4, seed=60))
        c.put(dkeys, rand_blocks(6, seed=61))  # in host memory only
        pin = {"model": "ctl-a", "tokens": host_tokens}
        assert _call(port, "POST", "pin", pin)[1]["pinned"] == 4
        assert _call(port, "POST", "pin", pin)[1]["pinned"] == 4
        assert _call(port, "POST", "unpin", pin) == (200, {"unpinned": 4})
        assert _call(port, "GET", "status")[1]["pins"]["blocks"] == 4, "one pin of two ended: still pinned"
        on_disk = {"model": "ctl-a", "tokens": disk_tokens, "tier": "disk"}
        assert _call(port, "POST", "pin", on_disk) == (200, {"pinned": 6, "missing": 0})
        pins = _call(port, "GET", "status")[1]["pins"]
        assert pins["disk_blocks"] == 6 and pins["disk_bytes"] == 6 * SMALL.block_bytes
        _flood(c, 1536, seed=800)  # past the host tier and the disk
        assert c.lookup_tiers(hkeys) == ["host"] * 4
        assert c.lookup_tiers(dkeys) == ["disk"] * 6, "pinned on disk: evicted from host memory, not from disk"
        assert c.get(dkeys).shape[0] == 6
    control.restart()
    pins = _call(port, "GET", "status")[1]["pins"]
    assert pins["blocks"] == 4 and pins["disk_blocks"] == 6
    with control.client(model="ctl-a") as c:
        _flood(c, 1536, seed=900)
        assert c.lookup(dkeys) == 6 and c.lookup_tiers(hkeys) == ["host"] * 4
        assert _call(port, "POST", "unpin", pin) == (200, {"unpinned": 4}), "the count survived the restart"
        assert _call(port, "POST", "unpin", on_disk) == (200, {"unpinned": 6})
        assert _call(port, "GET", "status")[1]["pins"] == {"blocks": 0, "bytes": 0, "disk_blocks": 0, "disk_bytes": 0}
        _flood(c, 1536, seed=1000)
        assert c.lookup(dkeys) < 6 and "host" not in c.lookup_tiers(hkeys), "unpinned, floods evict them"
        status, reply = _call(port, "POST", "pin", {**on_disk, "tier": "tape"})
        assert status == 400 and "tier must be host or disk" in reply["error"]


def test_a_saved_prompt_list_is_warmed_with_progress_and_a_result(control, tmp_path):
    port = control.port
    prompts = [_prompt(70 + i, 3) for i in range(40)]
    with control.client(model="ctl-a") as c:
        for i, p in enumerate(prompts[:36]):  # the last 4 were never cached
            c.put(c.block_keys(p), rand_blocks(3, seed=70 + i), durable=True)
    control.restart()  # host memory starts empty
    status, body = _call(port, "POST", "warm", {"model": "ctl-a", "prompts": prompts[:2]})
    assert status == 200 and body["warmed"] == 6 and body["from"] == {"disk": 6} and body["prompts"] == 2
    listing = tmp_path / "prompts.jsonl"
    listing.write_text("".join(json.dumps({"tokens": p} if i % 2 else p) + "\n" for i, p in enumerate(prompts)))
    out = subprocess.run([sys.executable, "-m", "tierkv", "control", "warm", "--prompts", str(listing), "--model",
                          "ctl-a", "--addr", str(port), "--token-file", str(tmp_path / "token")],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["prompts"] == 40 and body["warmed"] == 34 * 3 and body["already"] == 6 and body["missing"] == 12
    assert body["bytes"] == 34 * 3 * SMALL.block_bytes
    assert out.stderr.count("warm: ") == 2 and "warm: 40/40 prompts" in out.stderr, "progress after each batch"
    with control.client(model="ctl-a") as c:
        assert all(c.lookup_tiers(c.block_keys(p)) == ["host"] * 3 for p in prompts[:36])
    bad = {"model": "ctl-a", "prompts": [prompts[0], [1, "x"]]}
    assert _call(port, "POST", "warm", bad)[0] == 400
    assert _call(port, "POST", "warm", {"model": "ctl-a", "prompts": []})[0] == 400


def test_delete_by_tenant_takes_its_blocks_in_every_namespace_and_kv_events_announce_it(daemon_factory, tmp_path):
    from tests.daemon.test_kv_events import settle
    from tierkv.client.events import EventIndex

    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    port = free_port()
    ep, rep = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    d = daemon_factory(["--metrics-addr", str(port), "--control-token-file", str(token), "--kv-events", ep,
                        "--kv-events-replay", rep])
    index = EventIndex(ep, replay=rep).start()
    try:
        with d.client(model="ctl-a") as a, d.client(model="ctl-b") as b:
            for c, seed in ((a, 1), (b, 2)):
                for tenant in ("gone", "stays"):
                    keys = chain_keys(c.fingerprint, _prompt(seed, 4), BT, salt_root(c.fingerprint, tenant))
                    c.put(keys, rand_blocks(4, seed=seed), durable=True, tenant=tenant)
            assert settle(d, index) == {"CPU": 16, "DISK": 16}
            pin = {"model": "ctl-a", "tokens": _prompt(1, 4), "salt": "gone"}
            assert _call(port, "POST", "pin", pin)[1]["pinned"] == 4
            assert _call(port, "POST", "delete", {"tenant": "gone", "tiers": ["host"]}) == (200, {"deleted": 4})
            assert _call(port, "POST", "delete", {"tenant": "gone", "model": "ctl-a", "force": True}) == \
                (200, {"deleted": 4})
            assert settle(d, index) == {"CPU": 8, "DISK": 12}
            assert _call(port, "POST", "delete", {"tenant": "gone"}) == (200, {"deleted": 4})
            assert settle(d, index) == {"CPU": 8, "DISK": 8}, "every deletion is in the events"
            for c, seed in ((a, 1), (b, 2)):
                stays = chain_keys(c.fingerprint, _prompt(seed, 4), BT, salt_root(c.fingerprint, "stays"))
                gone = chain_keys(c.fingerprint, _prompt(seed, 4), BT, salt_root(c.fingerprint, "gone"))
                assert c.lookup(stays) == 4 and c.lookup(gone) == 0
            status, reply = _call(port, "POST", "delete", {"tenant": "x", "tokens": _prompt(1, 4), "model": "ctl-a"})
            assert status == 400 and "not both" in reply["error"]
    finally:
        index.close()


def test_quotas_and_what_each_tenant_holds_on_disk_outlive_a_restart(control):
    port = control.port
    with control.client(model="ctl-a") as c:
        _call(port, "POST", "quotas", {"tenant": "a", "host": 32 * 8192, "disk": 64 * 8192})
        _flood_as(c, "a", 16, seed=500)  # durable: 16 blocks on disk and in host memory
        before = _call(port, "GET", "tenants")[1]["tenants"]["a"]
        assert before["used"]["host"] == 16 * 8192 and before["used"]["disk"] > 0
    control.restart()
    after = _call(port, "GET", "tenants")[1]["tenants"]["a"]
    assert after["quota"] == {"host": 32 * 8192, "disk": 64 * 8192}
    assert after["used"] == {"host": 0, "disk": before["used"]["disk"]}, "its disk blocks count for it again"
    assert _call(port, "GET", "status")[1]["tenants"]["a"]["quota"]["disk"] == 64 * 8192


def test_a_tenants_hit_rate_counts_blocks_served_against_blocks_its_engine_computed(control):
    from tierkv.core.errors import BadRequest

    port = control.port
    with control.client(model="ctl-a") as c:
        _call(port, "POST", "quotas", {"tenant": "t", "host": 1 << 20})
        root = salt_root(c.fingerprint, "t")
        keys = chain_keys(c.fingerprint, _prompt(90, 4), BT, root)
        assert c.offer([(root, keys, 0, False, "t")]) == [(4, 4)]  # computed by its engine: misses
        c.put(keys, rand_blocks(4, seed=90), tenant="t")
        c.get(keys)
        c.get(keys[:2])
        t = _call(port, "GET", "tenants")[1]["tenants"]["t"]
        assert (t["hits"], t["misses"], t["hit_rate"]) == (6, 4, 0.6)
        assert c.offer([(root, keys, 0, False)]) == [(4, 4)], "an offer without a tenant counts for none"
        assert _call(port, "GET", "tenants")[1]["tenants"]["t"]["misses"] == 4
        with pytest.raises(BadRequest, match="tenant"):
            c.offer([(root, keys, 0, False, "")])

"""Prometheus /metrics of a real daemon, scraped over HTTP and parsed with prometheus-client's parser."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import redis_servers
from tests.helpers import REPO, SMALL, keys_for, rand_blocks
from tests.redis_servers import need_redis
from tierkv.daemon.metrics import parse_addr

redis_factory = redis_servers.redis_factory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as {(name, sorted labels): value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_scrape_counters_rise_with_traffic(daemon_factory):
    port = free_port()
    d = daemon_factory(["--metrics-addr", f"127.0.0.1:{port}"])
    before = scrape(port)
    assert before[("tierkv_tier_capacity_bytes", (("tier", "host"),))] == 256 << 20
    assert before[("tierkv_tier_hits_total", (("tier", "host"),))] == 0
    assert ("tierkv_lookup_index_fill_ratio", ()) in before
    with d.client() as c:
        keys = keys_for(c, 8)
        c.put(keys, rand_blocks(8))
        c.get(keys)
        c.get(keys)
        mid = scrape(port)
        assert mid[("tierkv_clients", ())] == 1
    after = scrape(port)
    host = (("tier", "host"),)
    assert after[("tierkv_tier_hits_total", host)] >= 16
    assert after[("tierkv_tier_blocks", host)] == 8
    assert after[("tierkv_tier_used_bytes", host)] >= 8 * SMALL.block_bytes
    assert after[("tierkv_tier_bytes_in_total", host)] >= 8 * SMALL.block_bytes
    assert after[("tierkv_tier_bytes_out_total", host)] >= 16 * SMALL.block_bytes  # two gets of 8 blocks
    assert after[("tierkv_requests_total", ())] > before[("tierkv_requests_total", ())]
    ns = [k for k in after if k[0] == "tierkv_namespace_hits_total"]
    assert ns and after[ns[0]] >= 16
    # the latency histogram: every op served shows up by name, with a count and +Inf bucket equal
    commits = after[("tierkv_request_duration_seconds_count", (("op", "commit"),))]
    assert commits >= 1
    assert after[("tierkv_request_duration_seconds_bucket", (("le", "+Inf"), ("op", "commit")))] == commits
    assert after[("tierkv_request_duration_seconds_sum", (("op", "commit"),))] > 0
    assert ("tierkv_request_duration_seconds_count", (("op", "hello"),)) in after


def test_metrics_off_by_default(daemon):
    from tierkv.client.admin import request
    from tierkv.core.errors import BadRequest

    assert "metrics on" not in daemon.log.read_text()
    with pytest.raises(BadRequest, match="fixed at start-up"):
        request(daemon.socket, "TUNE", {"settings": {"server.metrics_addr": "9464"}})


def test_parse_addr():
    assert parse_addr("9464") == ("127.0.0.1", 9464)
    assert parse_addr("0.0.0.0:9464") == ("0.0.0.0", 9464)
    assert parse_addr("[::1]:9464") == ("::1", 9464)
    for bad in ("", "host:", "x:70000", "abc"):
        with pytest.raises(ValueError, match="metrics_addr"):
            parse_addr(bad)


def test_bad_metrics_addr_is_one_line_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tierkv", "serve", "--socket", str(tmp_path / "s"), "--data-dir",
                        str(tmp_path / "d"), "--metrics-addr", "localhost:99999"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "metrics_addr" in r.stderr
    assert "Traceback" not in r.stderr


def test_grafana_dashboard_uses_exported_names(daemon_factory):
    import json
    import re

    dash = json.loads((REPO / "configs" / "grafana-tierkv.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {n for e in exprs for n in re.findall(r"\btierkv_[a-z0-9_]+", e)}
    port = free_port()
    d = daemon_factory(["--metrics-addr", str(port)])
    with d.client() as c:
        c.put(keys_for(c, 2), rand_blocks(2))
    exported = {name for name, _ in scrape(port)}
    exported.add("tierkv_remote_breaker_state")  # exported only while a remote tier is configured
    assert used and used <= exported, used - exported


@need_redis
def test_remote_tier_metrics_and_breaker(daemon_factory, redis_factory):
    import time

    srv = redis_factory()
    port = free_port()
    d = daemon_factory(["--metrics-addr", str(port), "--remote", srv.url, "--remote-admission", "all"])
    with d.client() as c:
        keys = keys_for(c, 4, seed=3)
        c.put(keys, rand_blocks(4, seed=3))
        deadline = time.monotonic() + 20
        while scrape(port).get(("tierkv_link_bytes_total", (("link", "host->remote"),)), 0) < SMALL.block_bytes:
            assert time.monotonic() < deadline, "write-through never reached the remote tier"
            time.sleep(0.05)
        m = scrape(port)
        assert m[("tierkv_remote_breaker_state", (("state", "up"),))] == 1
        assert m[("tierkv_tier_capacity_bytes", (("tier", "remote"),))] >= 0
        srv.kill()
        deadline = time.monotonic() + 20
        while scrape(port)[("tierkv_remote_breaker_state", (("state", "up"),))] == 1:
            assert time.monotonic() < deadline, "the breaker never left the up state"
            c.put(keys_for(c, 2, seed=int(time.monotonic() * 1000)), rand_blocks(2))
            c.lookup(keys_for(c, 8, seed=99))
            time.sleep(0.1)
        m = scrape(port)
        assert m[("tierkv_remote_breaker_state", (("state", "down"),))] + \
            m[("tierkv_remote_breaker_state", (("state", "read-only"),))] == 1


def test_lookup_over_http_answers_a_router(daemon_factory):
    """``GET /lookup`` on the metrics port: the leading tokens of a prompt each tier holds, keyed as the
    connected engine of the model keys them; a bad query is a 400 with one error line, /metrics unchanged."""
    import json
    import urllib.error

    port = free_port()
    d = daemon_factory(["--metrics-addr", f"127.0.0.1:{port}"])
    bt = SMALL.block_tokens
    tokens = list(range(900, 900 + 3 * bt + 1))

    def get(query: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/lookup?{query}", timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    with d.client(model="router-h") as c:
        c.put(c.block_keys(tokens)[:2], rand_blocks(2, seed=4))
        ids = ",".join(map(str, tokens))
        assert get(f"model=router-h&tokens={ids}") == (200, {
            "tokens": len(tokens), "cached_tokens": 2 * bt, "tiers": {"gpu": 0, "host": 2 * bt, "disk": 0, "remote": 0}})
        for query, needle in ((f"tokens={ids}", "model is required"), ("model=router-h&tokens=1,x", "tokens must"),
                              (f"model=nope&tokens={ids}", "no connected engine serves model 'nope'"),
                              (f"model=router-h&tp_rank=-1&tokens={ids}", "tp_rank")):
            status, body = get(query)
            assert status == 400 and needle in body["error"], (query, body)
        assert any(name.startswith("tierkv_") for name, _ in scrape(port))


def test_memory_samples_count_the_daemons_own_structures(daemon_factory, tmp_path):
    """``TIERKV_MEMDEBUG`` samples include the sizes of the daemon's records, policies and connections."""
    import json

    from tests.helpers import wait_for

    path = tmp_path / "mem.jsonl"
    d = daemon_factory(env={"TIERKV_MEMDEBUG": str(path), "TIERKV_MEMDEBUG_S": "0.1"})
    with d.client() as c:
        c.put(keys_for(c, 3, seed=5), rand_blocks(3, seed=5))

        def sampled() -> dict:
            rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
            return next((r for r in reversed(rows) if r.get("blocks") == 3), {})

        assert wait_for(lambda: bool(sampled()), timeout=10)
        row = sampled()
        assert row["host_policy"] == 3 and row["conns"] >= 1 and row["threads"] > 1 and row["history"] >= 0

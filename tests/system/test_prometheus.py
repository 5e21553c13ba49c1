"""The Grafana dashboard against a real Prometheus: a daemon under traffic is scraped by Prometheus
(Debian's package, which tools/ensure_services.sh installs when it can), and every PromQL expression
of configs/grafana-tierkv.json, evaluated through Prometheus's HTTP API, returns data."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import pytest

from tests import redis_servers
from tests.daemon.test_metrics import free_port
from tests.helpers import REPO, keys_for, rand_blocks
from tests.redis_servers import need_redis

PROMETHEUS = shutil.which("prometheus")
redis_server = redis_servers.redis_server

pytestmark = pytest.mark.skipif(not PROMETHEUS, reason="prometheus not on PATH (tools/ensure_services.sh "
                                "installs Debian's package when it runs as root)")


def dashboard_exprs() -> list[str]:
    dash = json.loads((REPO / "configs" / "grafana-tierkv.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def query(port: int, expr: str) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def traffic(d, stop: threading.Event) -> None:
    """Puts past the host tier (evictions, demotions), gets (hits), lookups of absent keys (misses)."""
    with d.client() as c:
        i = 0
        while not stop.is_set():
            keys = keys_for(c, 32, seed=i)
            c.put(keys, rand_blocks(32, seed=i))
            c.get(keys[:8])
            c.get(keys_for(c, 4, seed=i)[:4])
            try:
                c.get(keys_for(c, 2, seed=10_000 + i))
            except Exception:  # a miss is the point
                pass
            i += 1
            time.sleep(0.05)


@need_redis
def test_every_dashboard_query_returns_data(daemon_factory, redis_server, tmp_path):
    metrics, prom = free_port(), free_port()
    d = daemon_factory(["--metrics-addr", f"127.0.0.1:{metrics}", "--host-capacity", "2MiB", "--slab-bytes", "1MiB",
                        "--remote", redis_server.url, "--remote-admission", "all"])
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                   f"scrape_configs:\n  - job_name: tierkv\n    static_configs:\n      - targets: ['127.0.0.1:{metrics}']\n")
    stop = threading.Event()
    load = threading.Thread(target=traffic, args=(d, stop), daemon=True)
    load.start()
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        exprs = [e.replace("$instance", ".*").replace("$__rate_interval", "15s") for e in dashboard_exprs()]
        empty: list[str] = exprs
        deadline = time.monotonic() + 60
        while empty and time.monotonic() < deadline:
            time.sleep(2)
            try:
                results = {e: query(prom, e) for e in empty}
            except OSError:  # Prometheus still starting
                continue
            for e, r in results.items():
                assert r["status"] == "success", (e, r)
            empty = [e for e, r in results.items() if not r["data"]["result"]]
        assert not empty, f"dashboard queries without data: {empty}"
        up = query(prom, "up")["data"]["result"]
        assert up and up[0]["value"][1] == "1"
    finally:
        stop.set()
        load.join(30)
        proc.terminate()
        proc.wait(30)
        log.close()

"""Prefill/decode disaggregation through tierkv: vLLM's real CPU build, real daemons, a real Redis.

One fleet serves the module: daemons A and B sharing a Redis remote tier, a prefill vLLM
(``kv_producer``) and a decode vLLM (``kv_consumer``) on A, a second decode vLLM on B, and two
``tierkv pd-proxy`` processes (prefill + decode on A; prefill on A + decode on B). A subscriber follows
daemon A's KV events. The last test kills the prefill instance.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from _demo_model import ensure_converted
from _vllm_server import VllmServer, connector_config, free_port

from tests.helpers import Daemon
from tests.redis_servers import REDIS_CLI, REDIS_SERVER, RedisServer
from tierkv.client.events import EventIndex

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.redis, pytest.mark.timeout(1500),
              pytest.mark.skipif(not (REDIS_SERVER and REDIS_CLI), reason="redis-server not on PATH "
                                 "(tools/ensure_services.sh installs it)")]

BT = 128
DEV = {"VLLM_SERVER_DEV_MODE": "1"}
DAEMON_ARGS = ["--host-capacity", "512MiB", "--disk-capacity", "2GiB", "--slab-bytes", "32MiB"]


def chat(topic: str, rules: int = 50, question: str = "How do I join?") -> list[dict[str, str]]:
    rules_text = " ".join(f"Rule {i}: members of the {topic} library return items within {i + 2} days and clean them."
                          for i in range(rules))
    return [{"role": "system", "content": f"You are the assistant of the {topic} tool library. {rules_text}"},
            {"role": "user", "content": question}]


class Proxy:
    """A ``tierkv pd-proxy`` subprocess, and a view of it with the VllmServer client methods."""

    def __init__(self, prefill: VllmServer, decode: VllmServer, log: Path) -> None:
        self.port = free_port()
        self._log = open(log, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "tierkv", "pd-proxy", "--prefill", prefill.url,
                                      "--decode", decode.url, "--port", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT)
        self.view = VllmServer(decode.model_dir, None, log, port=self.port)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(self.view.url + "/health", timeout=2)
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"pd-proxy did not start: {log.read_text()[-2000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self._log.close()


class Fleet:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.model_dir = str(ensure_converted())
        self.redis = RedisServer(unixsocket=True).start()
        self.ep, self.rep = f"ipc://{work}/events", f"ipc://{work}/events-replay"
        remote = ["--remote", self.redis.url]
        self.a = Daemon(work / "a", [*DAEMON_ARGS, *remote, "--kv-events", self.ep, "--kv-events-replay", self.rep])
        self.b = Daemon(work / "b", [*DAEMON_ARGS, *remote])
        self.servers: list[VllmServer] = []
        self.proxies: list[Proxy] = []
        for d in (self.a, self.b):
            d.workdir.mkdir(parents=True, exist_ok=True)
            d.start()
        self.events = EventIndex(self.ep, replay=self.rep).start()
        self.prefill = self._server("prefill", self.a, "kv_producer")
        self.decode = self._server("decode-a", self.a, "kv_consumer")
        self.decode_b = self._server("decode-b", self.b, "kv_consumer")
        for s in self.servers:
            s.start(wait=False)
        for s in self.servers:
            s.wait_ready()
        self.proxy = Proxy(self.prefill, self.decode, work / "proxy-a.log")
        self.proxies.append(self.proxy)
        self.proxy_b = Proxy(self.prefill, self.decode_b, work / "proxy-b.log")
        self.proxies.append(self.proxy_b)

    def _server(self, name: str, daemon: Daemon, role: str) -> VllmServer:
        s = VllmServer(self.model_dir, None, self.work / f"vllm-{name}.log", num_blocks=32, env=DEV,
                       connector={**connector_config(daemon.socket), "kv_role": role}, one_process=True)
        self.servers.append(s)
        return s

    def close(self) -> None:
        for p in self.proxies:
            p.stop()
        for s in self.servers:
            s.stop()
        self.events.close()
        for d in (self.a, self.b):
            d.stop()
        self.redis.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = None
    try:
        f = Fleet(tmp_path_factory.mktemp("pd"))
        yield f
    finally:
        if f is not None:
            f.close()


def blocks(d: Daemon) -> int:
    return sum(t["blocks"] for name, t in d.stats()["tiers"].items() if name != "remote")


def run_concurrently(fn, n: int) -> dict[int, object]:
    out: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i: out.update({i: fn(i)})) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return out


def test_pd_on_one_node_through_the_proxy(fleet):
    """Each request goes through the proxy: prefill (one token) on the producer, then the decode
    instance, streaming; decode loads at least 90% of the prompt from tierkv and answers as it does
    alone (the reference runs under a ``cache_salt`` no block was stored with). The producer's blocks
    reach the router's index from daemon A's events with the prompt's own token ids."""
    prompts = [chat(t) for t in ("ferry", "orchard", "quarry")]
    replies = run_concurrently(lambda i: fleet.proxy.view.chat(prompts[i], max_tokens=24), len(prompts))
    cpu = {tuple(ids) for ids in fleet.events.held("CPU").values()}
    for i, msgs in enumerate(prompts):
        got = replies[i]
        assert got.cached_tokens >= 0.9 * got.prompt_tokens, (got.cached_tokens, got.prompt_tokens)
        assert got.text == fleet.decode.chat(msgs, max_tokens=24, salt="pd-reference").text
        ids = fleet.decode.tokenize(msgs)
        full = [tuple(ids[j * BT:(j + 1) * BT]) for j in range(len(ids) // BT)]
        assert full and all(b in cpu for b in full), "the events carry every stored block's token ids"
    before = blocks(fleet.a)
    fleet.decode.chat(chat("tundra"), max_tokens=4)  # a consumer only loads
    assert blocks(fleet.a) == before


def test_pd_across_two_daemons_sharing_redis(fleet):
    """Prefill through daemon A, decode through daemon B: the producer's commits are written through
    to the shared Redis before its reply, and B's decode instance loads the prompt from there; daemon
    A's events announce the blocks on the remote tier."""
    prompts = [chat(t) for t in ("lantern", "meadow")]
    hits0 = fleet.b.stats()["tiers"]["remote"]["hits"]
    replies = run_concurrently(lambda i: fleet.proxy_b.view.chat(prompts[i], max_tokens=24), len(prompts))
    remote = {tuple(ids) for ids in fleet.events.held("REMOTE").values()}
    for i, msgs in enumerate(prompts):
        got = replies[i]
        assert got.cached_tokens >= 0.9 * got.prompt_tokens, (got.cached_tokens, got.prompt_tokens)
        assert got.text == fleet.decode_b.chat(msgs, max_tokens=24, salt="pd-reference").text
        ids = fleet.decode_b.tokenize(msgs)
        assert all(tuple(ids[j * BT:(j + 1) * BT]) in remote for j in range(len(ids) // BT)), \
            "daemon A's events announce the prompt's blocks on the remote tier"
    assert fleet.b.stats()["tiers"]["remote"]["hits"] > hits0


def test_prefill_killed_mid_request_still_answers_right(fleet):
    """The prefill instance dies while a request is in its prefill: the proxy goes on to decode, which
    recomputes, and the client gets the decode instance's own answer (never wrong text)."""
    msgs = chat("glacier", rules=120)
    ref = fleet.decode.chat(msgs, max_tokens=16, salt="pd-reference")
    out: dict[str, object] = {}
    t = threading.Thread(target=lambda: out.update(r=fleet.proxy.view.chat(msgs, max_tokens=16)))
    t.start()
    time.sleep(1.5)  # the prefill of ~2,600 tokens takes several seconds here
    proc = fleet.prefill.proc
    assert proc is not None
    os.killpg(proc.pid, signal.SIGKILL)
    t.join(600)
    assert not t.is_alive()
    got = out["r"]
    assert got.text == ref.text
    log = (fleet.work / "proxy-a.log").read_text()
    assert "the decode recomputes the prompt" in log, "the prefill died before it answered"
    with pytest.raises(urllib.error.HTTPError):  # the proxy reports the dead prefill as unhealthy
        urllib.request.urlopen(fleet.proxy.view.url + "/health", timeout=5)

"""Tenants and the control API on vLLM's real CPU build: a noisy tenant's flood and a quiet tenant's
prefixes, with and without a quota; a pinned prompt through a flood and a daemon restart; a deleted
prefix recomputed; a prompt warmed after a restart served from host memory. One daemon (15 host blocks over
11 on disk, LRU in both, every victim written; its control API on) and one vLLM server serve the module."""

from __future__ import annotations

import json
import urllib.request

import pytest
from _demo_model import MODEL_ID, ensure_converted
from _vllm_server import VllmServer

from tests.daemon.test_metrics import free_port
from tests.helpers import Daemon
from tests.system.test_vllm import BT, DEV, chat

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.timeout(900)]

TOKEN = "tenants-test-token-0123456789"
BLOCK = 2 * 30 * 3 * 64 * BT * 4  # a SmolLM2 block: 5.6 MiB


class Stack:
    def __init__(self, work) -> None:
        token = work / "token"
        token.write_text(TOKEN)
        token.chmod(0o600)
        self.port = free_port()
        self.daemon = Daemon(work / "daemon", ["--host-capacity", "96MiB", "--slab-bytes", "32MiB",
                                               "--disk-capacity", "64MiB", "--policy", "lru",
                                               "--metrics-addr", str(self.port), "--control-token-file", str(token)],
                             env={"TIERKV_DISK_POLICY": "lru", "TIERKV_DISK_ADMISSION": "all"})
        self.daemon.workdir.mkdir(parents=True, exist_ok=True)
        self.daemon.start()
        try:
            self.server = VllmServer(str(ensure_converted()), self.daemon.socket, work / "vllm.log", num_blocks=12,
                                     env=DEV, one_process=True).start()
        except BaseException:
            self.daemon.stop()
            raise

    def control(self, op: str, body: dict) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/{op}", data=json.dumps(body).encode(),
                                     method="POST", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    def served(self, msgs: list[dict], salt: str) -> tuple[int, str]:
        """Prompt tokens of ``msgs`` served from tierkv (vLLM's own cache emptied first), and the reply."""
        self.server.reset_prefix_cache()
        r = self.server.chat(msgs, salt=salt, max_tokens=8)
        return r.cached_tokens, r.text

    def flood(self, salt: str, n: int = 8) -> None:
        for i in range(n):
            self.server.chat(chat(f"flood-{salt}-{i}", rules=24), salt=salt, max_tokens=1)

    def close(self) -> None:
        self.server.stop()
        self.daemon.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("tenants"))
    yield s
    s.close()


def test_a_quota_keeps_a_quiet_tenants_prefixes_through_a_noisy_tenants_flood(stack):
    """Tenant B floods both tiers (26 blocks) over and over. Without a quota the quiet tenant's prompt is
    evicted (served from tierkv before the flood, not after); with a quota it holds, every token tierkv
    served before is served after, and the replies equal the ones computed."""
    results = {}
    for quiet in ("quiet-1", "quiet-2"):
        if quiet == "quiet-2":
            stack.control("quotas", {"tenant": quiet, "host": 6 * BLOCK, "disk": 6 * BLOCK})
        msgs = chat(f"apiary-{quiet}", rules=24)
        stack.server.chat(msgs, salt=quiet, max_tokens=8)
        before, text = stack.served(msgs, quiet)
        assert before >= 2 * BT
        stack.flood("noisy", 10)
        after, again = stack.served(msgs, quiet)
        results[quiet] = (before, after)
        assert again == text
    (b1, a1), (b2, a2) = results["quiet-1"], results["quiet-2"]
    assert a1 < b1, "without a quota the flood evicts the quiet tenant's prefix"
    assert a2 == b2, "with one, none of it"


def test_a_pinned_prompt_survives_a_flood_and_a_daemon_restart(stack):
    msgs = chat("observatory", rules=24)
    first = stack.server.chat(msgs, salt="pinned", max_tokens=8)
    tokens = stack.server.tokenize(msgs)
    pinned = stack.control("pin", {"model": MODEL_ID, "tokens": tokens, "salt": "pinned"})
    assert pinned == {"pinned": len(tokens) // BT, "missing": 0} and len(tokens) >= 2 * BT
    whole = (len(tokens) - 1) // BT * BT  # vLLM computes the prompt's last token itself
    stack.flood("noisy-2", 10)
    assert stack.served(msgs, "pinned") == (whole, first.text)
    stack.daemon.restart()
    stack.flood("noisy-3", 10)  # the connector reconnects; the pinned blocks are in host memory again
    assert stack.served(msgs, "pinned") == (whole, first.text)


def test_a_deleted_prefix_is_recomputed_and_answered_the_same(stack):
    """Delete by prefix and by tenant: the next request is served nothing from tierkv, recomputes, and
    answers as before (never wrong data, never an error)."""
    for salt, how in (("del-prefix", "prefix"), ("del-tenant", "tenant")):
        msgs = chat(f"lighthouse-{salt}", rules=24)
        first = stack.server.chat(msgs, salt=salt, max_tokens=8)
        tokens = stack.server.tokenize(msgs)
        whole = (len(tokens) - 1) // BT * BT
        assert stack.served(msgs, salt) == (whole, first.text)
        body = {"model": MODEL_ID, "tokens": tokens, "salt": salt} if how == "prefix" else {"tenant": salt}
        assert stack.control("delete", body)["deleted"] >= whole // BT
        assert stack.served(msgs, salt) == (0, first.text)


def test_warm_after_a_restart_makes_the_first_request_a_host_hit(stack):
    """A prompt pinned on disk outlives a restart there; warmed, its first request is served from host
    memory (no disk read on the request's path) and answers as before."""
    msgs = chat("orchard", rules=24)
    first = stack.server.chat(msgs, salt="warm", max_tokens=8)
    tokens = stack.server.tokenize(msgs)
    whole = (len(tokens) - 1) // BT * BT
    body = {"model": MODEL_ID, "tokens": tokens, "salt": "warm"}
    assert stack.served(msgs, "warm") == (whole, first.text)  # its blocks are committed
    # the disk (11 blocks) holds the earlier tests' pinned prompt and quota'd tenant: let them go
    stack.control("quotas", {"tenant": "quiet-2", "host": None, "disk": None})
    stack.control("unpin", {"model": MODEL_ID, "tokens": stack.server.tokenize(chat("observatory", rules=24)),
                            "salt": "pinned"})
    assert stack.control("pin", {**body, "tier": "disk"})["pinned"] == len(tokens) // BT
    stack.daemon.restart()
    stack.flood("noisy-4", 2)  # the connector reconnects
    warmed = stack.control("warm", body)
    assert warmed["from"] == {"disk": len(tokens) // BT} and warmed["missing"] == 0
    tiers = stack.daemon.stats()["tiers"]
    stack.server.reset_prefix_cache()
    assert stack.served(msgs, "warm") == (whole, first.text)
    after = stack.daemon.stats()["tiers"]
    assert after["host"]["hits"] - tiers["host"]["hits"] >= whole // BT
    assert after["disk"]["hits"] == tiers["disk"]["hits"], "nothing read from disk for the request"
    assert stack.control("unpin", {**body, "tier": "disk"})["unpinned"] == len(tokens) // BT

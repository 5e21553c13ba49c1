"""tierkv as vLLM's KV cache: vLLM's real CPU build, the real model, a real daemon.

One daemon and one vLLM OpenAI server serve the module (a vLLM start costs most of a minute); tests that
need a second server, a restart or an offline engine start their own. ``VLLM_SERVER_DEV_MODE`` lets a
test empty vLLM's own prefix cache, so the next request can only find its prefix in tierkv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import lmdb
import pytest
from _demo_model import MODEL_ID, ensure_converted
from _vllm_server import VllmServer, connector_config

from tests.helpers import Daemon, wait_for
from tierkv.codecs import read_header
from tierkv.core.keys import Namespace, chain_keys
from tierkv.core.layout import Layout
from tierkv.integrations.vllm.inputs import salt_root

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.timeout(900)]

# SmolLM2-135M in vLLM on the CPU: 30 layers, 3 KV heads of 64, 128-token blocks, float32.
LAYOUT = Layout(num_layers=30, num_kv_heads=3, head_dim=64, block_tokens=128, dtype="float32")
BT = LAYOUT.block_tokens
DEV = {"VLLM_SERVER_DEV_MODE": "1"}
# A small vLLM cache (12 blocks of 128 tokens) so concurrent requests preempt each other.
VLLM_BLOCKS = 12
DAEMON_ARGS = ["--host-capacity", "512MiB", "--disk-capacity", "2GiB", "--slab-bytes", "32MiB"]


def system_prompt(topic: str, rules: int = 30) -> str:
    rules = [f"Rule {i}: members of the {topic} library return items within {i + 2} days and clean them."
             for i in range(rules)]
    return f"You are the assistant of the {topic} tool library. " + " ".join(rules)


def chat(topic: str, question: str = "How do I join?", rules: int = 30) -> list[dict[str, str]]:
    return [{"role": "system", "content": system_prompt(topic, rules)}, {"role": "user", "content": question}]


def metric(server: VllmServer, name: str) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{")[0].split(" ")[0] == name)


class Stack:
    """The module's daemon and vLLM server."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.model_dir = str(ensure_converted())
        self.daemon = Daemon(work / "daemon", DAEMON_ARGS)
        self.daemon.workdir.mkdir(parents=True, exist_ok=True)
        self.daemon.start()
        try:
            self.server = self.new_server("a").start()
        except BaseException:
            self.daemon.stop()
            raise

    def new_server(self, name: str, **kw) -> VllmServer:
        return VllmServer(self.model_dir, self.daemon.socket, self.work / f"vllm-{name}.log", num_blocks=VLLM_BLOCKS,
                          env=DEV, **kw)

    def close(self) -> None:
        self.server.stop()
        self.daemon.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Stack:
    s = Stack(tmp_path_factory.mktemp("vllm"))
    yield s
    s.close()


def _identity(stack: Stack) -> str:
    """The identity the server's connector registered its namespace with (the model's weights and settings)."""
    found = {ns["identity"] for ns in stack.daemon.stats()["namespaces"].values() if ns["model"] == MODEL_ID}
    assert len(found) == 1 and len(found.pop()) == 32
    return next(ns["identity"] for ns in stack.daemon.stats()["namespaces"].values() if ns["model"] == MODEL_ID)


def blocks(stack: Stack) -> int:
    return sum(t["blocks"] for t in stack.daemon.stats()["tiers"].values())


def test_prompt_shorter_than_a_block_is_answered_and_stores_nothing(stack):
    before = blocks(stack)
    r = stack.server.chat([{"role": "user", "content": "Hi!"}], max_tokens=8)
    assert r.text and r.prompt_tokens < BT and r.cached_tokens == 0
    assert blocks(stack) == before


def test_a_request_loads_its_prefix_from_tierkv_with_identical_output(stack):
    msgs = chat("harbour")
    first = stack.server.chat(msgs)
    assert first.cached_tokens == 0
    stack.server.reset_prefix_cache()  # vLLM's own cache is empty: only tierkv has the prefix
    again = stack.server.chat(msgs)
    assert again.text == first.text
    assert again.cached_tokens == (first.prompt_tokens - 1) // BT * BT > 0
    deadline = time.monotonic() + 20  # the connector's counters reach vLLM's /metrics with its stats
    while metric(stack.server, "vllm:tierkv_hit_tokens_total") < again.cached_tokens and time.monotonic() < deadline:
        stack.server.chat([{"role": "user", "content": "Hi"}], max_tokens=1)
        time.sleep(0.5)
    assert metric(stack.server, "vllm:tierkv_hit_tokens_total") >= again.cached_tokens
    assert metric(stack.server, "vllm:tierkv_stored_tokens_total") > 0
    # the connector tells the daemon how many tokens each finished request generated
    assert wait_for(lambda: stack.daemon.stats()["tiers"]["host"]["reuse"]["finished_with_output_tokens"] >= 2)


def test_vllm_blocks_hold_the_models_keys_and_values_in_tierkv_layout(stack):
    """K and V land where every tierkv integration and codec expects them: the blocks vLLM stored equal
    the same prefix's K/V computed by transformers (another engine's kernels: float tolerance)."""
    import torch
    from _demo_model import load_model

    import tierkv
    from tierkv.integrations.transformers import layer_kv, new_cache

    msgs = chat("harbour")
    stack.server.chat(msgs, max_tokens=4)
    tokens = stack.server.tokenize(msgs)
    with tierkv.Client.connect(stack.daemon.socket, model=MODEL_ID, layout=LAYOUT, identity=_identity(stack)) as c:
        keys = c.block_keys(tokens)[:2]
        assert c.lookup(keys) == 2
        blocks = c.get(keys)  # [2, 2 (K, V), layers, heads, 128, 64]
    _tok, model = load_model(attn_implementation="sdpa")
    cache = new_cache(model)
    with torch.inference_mode():
        model(torch.tensor([tokens[:2 * BT]]), past_key_values=cache, use_cache=True)
    for layer in (0, 14, 29):
        k, v = layer_kv(cache, layer)  # [1, heads, tokens, dim]
        for b in range(2):
            span = slice(b * BT, (b + 1) * BT)
            torch.testing.assert_close(blocks[b, 0, layer], k[0, :, span], rtol=1e-3, atol=1e-3)
            torch.testing.assert_close(blocks[b, 1, layer], v[0, :, span], rtol=1e-3, atol=1e-3)


def test_cache_salt_keeps_tenants_apart(stack):
    msgs = chat("orchard")
    plain = stack.server.chat(msgs)
    stack.server.reset_prefix_cache()
    before = blocks(stack)
    salted = stack.server.chat(msgs, salt="tenant-a")
    assert salted.cached_tokens == 0 and salted.text == plain.text  # another tenant's blocks are not seen
    # its own are: the connector commits behind the step, and the store gate may skip a new tenant's first
    # prompt (the prior against the costs measured under load) and stores a block offered again
    for _ in range(3):
        wait_for(lambda: blocks(stack) > before, timeout=5)
        stack.server.reset_prefix_cache()
        if (again := stack.server.chat(msgs, salt="tenant-a")).cached_tokens > 0:
            break
    assert again.cached_tokens > 0 and again.text == plain.text
    stack.server.reset_prefix_cache()
    assert stack.server.chat(msgs, salt="tenant-b").cached_tokens == 0
    ns = Namespace(MODEL_ID, LAYOUT, identity=_identity(stack))
    assert salt_root(ns.fingerprint, "tenant-a") != salt_root(ns.fingerprint, "tenant-b")


def test_two_servers_share_one_daemon_and_the_blocks_outlive_the_first(stack):
    """A second server beside the first answers a prompt only the first has seen from its blocks; once the
    first is stopped (its connections gone), the second answers another of its prompts from tierkv too,
    and serves the module from then on."""
    msgs, later = chat("lighthouse"), chat("canal")
    on_a, before = stack.server.chat(msgs), stack.server.chat(later)
    b = stack.new_server("b", one_process=True).start()  # the module's later tests run on vLLM's one-process engine
    try:
        on_b = b.chat(msgs)  # B has never seen this prompt: its prefix comes from A's blocks
        assert on_b.cached_tokens > 0 and on_b.text == on_a.text
    finally:
        stack.server.stop()
        stack.server = b
    after = stack.server.chat(later)
    assert after.cached_tokens > 0 and after.text == before.text


OFFLINE = r"""
import json, os, sys
from vllm import LLM, SamplingParams
def main():
    model, kv, msgs = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=1408, kv_transfer_config=kv)
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=32))[0]
    print("RESULT " + json.dumps({"text": out.outputs[0].text, "cached": out.num_cached_tokens}))
if __name__ == "__main__":
    main()
"""


def test_offline_llm_in_another_process_reloads_the_servers_blocks(stack):
    msgs = chat("quarry")
    served = stack.server.chat(msgs)
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")  # the engine in the script's own process: a start 10 s shorter
    p = subprocess.run([sys.executable, "-c", OFFLINE, stack.model_dir,
                        json.dumps(connector_config(stack.daemon.socket)), json.dumps(msgs)],
                       capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    got = json.loads(lines[-1][7:])
    assert got["cached"] == served.cached_tokens or got["cached"] >= (served.prompt_tokens - 1) // BT * BT
    assert got["cached"] > 0 and got["text"] == served.text


def _lmdb_key(stack: Stack, msgs, block: int) -> bytes:
    fp = Namespace(MODEL_ID, LAYOUT, identity=_identity(stack)).fingerprint
    return fp + chain_keys(fp, stack.server.tokenize(msgs), BT)[block]


def test_a_corrupt_disk_block_is_recomputed_with_identical_output(stack):
    msgs = chat("foundry")
    first = stack.server.chat(msgs)
    assert first.prompt_tokens > 3 * BT
    key = _lmdb_key(stack, msgs, 1)
    stack.daemon.stop()  # SIGTERM: host blocks are flushed to the disk tier
    env = lmdb.open(os.path.join(stack.daemon.data_dir, "disk"), subdir=True, map_size=1 << 32)
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(key))
        value[read_header(bytes(value)).header_len + 64] ^= 0x40  # payload damage: caught when read
        txn.put(key, bytes(value))
    env.close()
    stack.daemon.start()
    stack.server.reset_prefix_cache()
    again = stack.server.chat(msgs)
    assert again.text == first.text
    assert stack.daemon.stats()["tiers"]["disk"]["corrupt"] >= 1


def test_daemon_killed_mid_request_requests_are_still_answered(stack):
    msgs = chat("mill")
    ref = stack.server.chat(msgs, max_tokens=48)
    stack.server.reset_prefix_cache()
    log_before = len(stack.server.log_path.read_text())
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=stack.server.chat(msgs, max_tokens=48)))
    t.start()
    time.sleep(0.3)
    stack.daemon.kill()
    t.join(300)
    assert result["r"].text == ref.text
    for topic in ("bakery", "forge", "tannery"):  # served while the daemon is gone
        assert stack.server.chat(chat(topic), max_tokens=8).text
    stack.daemon.start()
    msgs2 = chat("ropewalk")
    first = stack.server.chat(msgs2)  # the connector finds the new daemon by itself
    stack.server.reset_prefix_cache()
    assert stack.server.chat(msgs2).cached_tokens > 0 and first.text
    log = stack.server.log_path.read_text()[log_before:]  # one line for the outage, not one per request
    assert log.count("tierkv: lost the daemon") + log.count("tierkv: daemon not reachable") == 1, log


def test_preempted_requests_resume_with_identical_output(stack):
    # Three prompts of 3 blocks (no prefix shared) fit vLLM's 11 usable blocks together; each grows to 4
    # while decoding, so vLLM preempts one, whose blocks then come back from tierkv.
    long = {"ignore_eos": True}
    convs = [chat(topic, rules=14) for topic in ("wharf", "dock", "pier")]
    alone = []
    for m in convs:
        stack.server.reset_prefix_cache()
        alone.append(stack.server.chat(m, max_tokens=100, extra=long))
    preempted = metric(stack.server, "vllm:num_preemptions_total")
    stack.server.reset_prefix_cache()
    out: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i, m=m: out.update({i: stack.server.chat(m, max_tokens=100, extra=long)}))
               for i, m in enumerate(convs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert _stats_metric(stack, "vllm:num_preemptions_total", preempted + 1) > preempted  # periodic stats
    assert [out[i].text for i in range(len(convs))] == [a.text for a in alone]


def _stats_metric(stack: Stack, name: str, at_least: float, timeout: float = 20.0) -> float:
    """A connector counter on vLLM's /metrics once it reaches ``at_least`` (the counters arrive with
    vLLM's periodic stats; a one-token request nudges them)."""
    deadline = time.monotonic() + timeout
    while metric(stack.server, name) < at_least and time.monotonic() < deadline:
        stack.server.chat([{"role": "user", "content": "Hi"}], max_tokens=1)
        time.sleep(0.5)
    return metric(stack.server, name)


def _restart_daemon(stack: Stack, faults: str | None = None) -> None:
    """Restart the daemon (SIGTERM flushes the host tier to disk: the new daemon holds every block on
    disk only), optionally with a disk fault rule, and wait until vLLM's connector is back."""
    stack.daemon.stop()
    stack.daemon.env.pop("TIERKV_FAULTS", None)
    if faults:
        stack.daemon.env["TIERKV_FAULTS"] = faults
    stack.daemon.start()
    stack.server.reset_prefix_cache()
    time.sleep(1.5)  # the connector finds a restarted daemon within a second


def test_a_prefix_only_on_disk_loads_asynchronously_with_identical_output(stack):
    msgs = chat("granary")
    ref = stack.server.chat(msgs)
    before = metric(stack.server, "vllm:tierkv_async_loads_total")
    errors = metric(stack.server, "vllm:tierkv_load_errors_total")
    # each disk read takes 20 ms: the promotion the connector starts when the request is queued cannot
    # end before vLLM schedules it (from a fast disk it may, and the load then runs in the step, from
    # host memory); the load stays well within its bound of at least half a second
    _restart_daemon(stack, faults="read:sleep=0.02")
    assert stack.daemon.stats()["tiers"]["host"]["blocks"] == 0
    again = stack.server.chat(msgs)
    assert again.text == ref.text and again.cached_tokens == (ref.prompt_tokens - 1) // BT * BT > 0
    assert _stats_metric(stack, "vllm:tierkv_async_loads_total", before + 1) >= before + 1
    assert metric(stack.server, "vllm:tierkv_load_errors_total") == errors


def test_requests_sharing_a_prefix_read_it_from_disk_once(stack):
    sys_msgs = chat("saddlery")
    ref = [stack.server.chat(sys_msgs[:1] + [{"role": "user", "content": q}]) for q in ("Hours?", "Fees?")]
    _restart_daemon(stack)
    n = (min(r.prompt_tokens for r in ref) - 1) // BT  # the shared system prompt's full blocks
    out: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i, q=q: out.update(
        {i: stack.server.chat(sys_msgs[:1] + [{"role": "user", "content": q}])})) for i, q in enumerate(("Hours?", "Fees?"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [out[i].text for i in range(2)] == [r.text for r in ref]
    assert all(out[i].cached_tokens >= n * BT for i in range(2))
    assert stack.daemon.stats()["tiers"]["disk"]["hits"] == n  # each block read from disk once


def test_a_stalled_disk_ends_the_load_within_its_bound_and_vllm_recomputes(stack):
    msgs = chat("cooperage")
    ref = stack.server.chat(msgs, max_tokens=16)
    _restart_daemon(stack, faults="read:sleep=60")
    try:
        t0 = time.monotonic()
        again = stack.server.chat(msgs, max_tokens=16)
        took = time.monotonic() - t0
        assert again.text == ref.text and took < 20.0  # the bound, not the disk's 60 s
        # the daemon killed while a load waits on the stalled disk: answered all the same
        stack.server.reset_prefix_cache()
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(r=stack.server.chat(msgs, max_tokens=16)))
        t.start()
        time.sleep(0.3)
        stack.daemon.kill()
        t.join(120)
        assert not t.is_alive() and result["r"].text == ref.text
    finally:
        stack.daemon.kill()
        stack.daemon.env.pop("TIERKV_FAULTS", None)
        stack.daemon.start()


def test_the_store_gate_stops_storing_prompts_nothing_reuses_and_stores_one_that_comes_back(stack):
    """A stream of prompts nothing reuses ends up stored no more (the connector's and the daemon's
    counters say so); a prompt that then comes back is stored again and served. Under a salt of its
    own: the gate learns per namespace and salt, apart from the module's other prompts. One at a time,
    each request ends with the engine idle: the connector stores the blocks the gate kept for an idle
    engine (a longer run, which ends too) out of the pages vLLM frees after that step."""
    salt = "gate-tenant"
    before = stack.daemon.stats()["store_gate"]
    gated = metric(stack.server, "vllm:tierkv_store_gated_total")
    idle = metric(stack.server, "vllm:tierkv_store_idle_total")

    def prompt(i: int) -> list[int]:
        return list(range(20_000 + 400 * i, 20_000 + 400 * i + 2 * BT + 40))

    for i in range(24):
        stack.server.complete(prompt(i), max_tokens=1, salt=salt)
    after = stack.daemon.stats()["store_gate"]
    assert after["skipped"] - before["skipped"] >= 8 and after["returns"] == before["returns"]
    assert after["idle"] - before["idle"] >= 8
    deadline = time.monotonic() + 20  # the connector's counters reach /metrics with vLLM's stats
    while (metric(stack.server, "vllm:tierkv_store_gated_total") <= gated
           or metric(stack.server, "vllm:tierkv_store_idle_total") <= idle) and time.monotonic() < deadline:
        stack.server.complete([1, 2, 3], max_tokens=1)
        time.sleep(0.5)
    assert metric(stack.server, "vllm:tierkv_store_gated_total") > gated
    assert metric(stack.server, "vllm:tierkv_store_idle_total") > idle
    stack.server.reset_prefix_cache()  # the tenth prompt: past the in-step run (6), within the idle one (16)
    assert stack.server.complete(prompt(10), max_tokens=1, salt=salt)["cached_tokens"] == 2 * BT
    stack.server.reset_prefix_cache()  # stored idle under the tenant's salt: nothing for a request without it
    assert stack.server.complete(prompt(10), max_tokens=1)["cached_tokens"] == 0
    prompt = list(range(40_000, 40_000 + 2 * BT + 40))
    served = []
    for _ in range(4):  # the same prompt again, vLLM's own cache emptied each time
        stack.server.reset_prefix_cache()
        served.append(stack.server.complete(prompt, max_tokens=1, salt=salt)["cached_tokens"])
    assert served[0] == 0 and served[-1] == 2 * BT, served

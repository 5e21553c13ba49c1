"""Tensor parallelism 2 through vLLM's real CPU build and a real daemon: a small random-weight Llama with
two KV heads (one per rank) answers a prompt with tierkv and stores it, each rank its own heads under
its own namespace; with vLLM's own cache emptied (``VLLM_SERVER_DEV_MODE``) it loads the prompt from
tierkv and answers the same tokens with the same log-probabilities. One server per configuration."""

from __future__ import annotations

import time

import pytest
from _vllm_server import VllmServer

from tests import tiny_models
from tests.helpers import Daemon, has_cuda
from tests.system.test_vllm_models import HIT, PROMPT

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.timeout(1500)]

DEV = {"VLLM_SERVER_DEV_MODE": "1"}  # lets a test empty vLLM's own prefix cache
TP_ENV = DEV  # each rank runs the suite's one unbound OpenMP thread (tests/conftest.py)


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path / "daemon", ["--host-capacity", "256MiB", "--slab-bytes", "8MiB"])
    d.workdir.mkdir(parents=True, exist_ok=True)
    d.start()
    yield d
    d.stop()


def llama_server(tmp_path, daemon: Daemon, name: str, args: list[str], env: dict | None = None) -> VllmServer:
    """A vLLM server of the small Llama with the tierkv connector on ``daemon``."""
    model = tiny_models.make("llama", tmp_path / "models")
    return VllmServer(str(model), daemon.socket, tmp_path / f"vllm-{name}.log", env=env or DEV, args=args,
                      one_process=True)  # the ranks' workers are processes of their own all the same


def llama_namespaces(daemon: Daemon) -> list[dict]:
    return [ns for ns in daemon.stats()["namespaces"].values() if ns["model"].startswith("tiny-llama")]


def _stored(daemon: Daemon, ranks: int) -> list[dict]:
    """The model's namespaces once every rank's holds the prompt (commits run behind the step), or after 30 s."""
    deadline = time.monotonic() + 30
    spaces = llama_namespaces(daemon)
    while time.monotonic() < deadline and not (len(spaces) == ranks and all(ns["blocks"] >= HIT // 128
                                                                              for ns in spaces)):
        time.sleep(0.1)
        spaces = llama_namespaces(daemon)
    return spaces


def test_tp2_each_rank_loads_its_heads_and_vllm_answers_as_before(tmp_path, daemon):
    tp = ["--tensor-parallel-size", "2"]
    with llama_server(tmp_path, daemon, "tp2", tp, TP_ENV) as s:
        computed = s.complete(PROMPT)  # nothing cached yet: vLLM computes the whole prompt
        spaces = _stored(daemon, 2)
        assert sorted((ns["tp_rank"], ns["tp_size"]) for ns in spaces) == [(0, 2), (1, 2)]
        assert len({ns["blocks"] for ns in spaces}) == 1 and spaces[0]["blocks"] >= HIT // 128
        s.reset_prefix_cache()  # vLLM's own cache is empty: each rank loads its heads from tierkv
        loaded = s.complete(PROMPT)
        hit = s.metric("vllm:tierkv_hit_tokens_total")
        errors = s.metric("vllm:tierkv_load_errors_total")
    assert hit >= HIT and errors == 0, (hit, errors)
    assert loaded["tokens"] == computed["tokens"]
    assert loaded["logprobs"] == pytest.approx(computed["logprobs"], abs=1e-3)
    assert loaded["cached_tokens"] >= HIT


def _cpu_fp8() -> bool:
    """vLLM's CPU build keeps an fp8 KV cache only on x86 with AVX-512 (or AMX)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return " avx512f" in flags or " amx_tile" in flags


# a GPU test that also runs where the CPU build can keep an fp8 cache
@pytest.mark.skipif(not _cpu_fp8() and not has_cuda(), reason="an fp8 KV cache needs CUDA or a CPU with "
                    "AVX-512/AMX (vLLM's CPU build refuses it on AVX2)")
@pytest.mark.gpu if not _cpu_fp8() else pytest.mark.vllm
def test_fp8_kv_cache_loads_its_pages_as_stored(tmp_path, daemon):
    """vLLM with ``--kv-cache-dtype fp8``: the pages go to tierkv as the cache holds them (an fp8
    namespace), and with vLLM's own cache emptied they load from there and answer the same tokens."""
    fp8 = ["--kv-cache-dtype", "fp8"]
    with llama_server(tmp_path, daemon, "fp8", fp8) as s:
        computed = s.complete(PROMPT)
        spaces = _stored(daemon, 1)
        assert spaces and all("float8" in ns["layout"]["dtype"] for ns in spaces), spaces
        s.reset_prefix_cache()
        loaded = s.complete(PROMPT)
        assert s.metric("vllm:tierkv_hit_tokens_total") >= HIT
    assert loaded["tokens"] == computed["tokens"]

"""Tensor parallelism 2 through vLLM's real CPU build and a real daemon: a small random-weight Llama with
two KV heads (one per rank) answers a prompt with tierkv and stores it, each rank its own heads under
its own namespace; a restarted vLLM (its own cache empty) loads the prompt from tierkv and answers the
same tokens with the same log-probabilities."""

from __future__ import annotations

import pytest
from _vllm_server import VllmServer

from tests import tiny_models
from tests.helpers import Daemon, has_cuda
from tests.system.test_vllm_models import HIT, PROMPT

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.timeout(1500)]

# one core per rank: each worker binds its own
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


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
    return VllmServer(str(model), daemon.socket, tmp_path / f"vllm-{name}.log", env=env or {}, args=args)


def llama_namespaces(daemon: Daemon) -> list[dict]:
    return [ns for ns in daemon.stats()["namespaces"].values() if ns["model"].startswith("tiny-llama")]


def test_tp2_after_a_restart_each_rank_loads_its_heads_and_vllm_answers_as_before(tmp_path, daemon):
    tp = ["--tensor-parallel-size", "2"]
    with llama_server(tmp_path, daemon, "store", tp, TP_ENV) as s:
        computed = s.complete(PROMPT)  # nothing cached yet: vLLM computes the whole prompt
    spaces = llama_namespaces(daemon)
    assert sorted((ns["tp_rank"], ns["tp_size"]) for ns in spaces) == [(0, 2), (1, 2)]
    assert len({ns["blocks"] for ns in spaces}) == 1 and spaces[0]["blocks"] >= HIT // 128
    with llama_server(tmp_path, daemon, "restart", tp, TP_ENV) as s:
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
def test_fp8_kv_cache_after_a_restart_loads_its_pages_as_stored(tmp_path, daemon):
    """vLLM with ``--kv-cache-dtype fp8``: the pages go to tierkv as the cache holds them (an fp8
    namespace), and a restarted vLLM loads them and answers the same tokens."""
    fp8 = ["--kv-cache-dtype", "fp8"]
    with llama_server(tmp_path, daemon, "fp8-store", fp8) as s:
        computed = s.complete(PROMPT)
    spaces = llama_namespaces(daemon)
    assert spaces and all("float8" in ns["layout"]["dtype"] for ns in spaces), spaces
    with llama_server(tmp_path, daemon, "fp8-restart", fp8) as s:
        loaded = s.complete(PROMPT)
        assert s.metric("vllm:tierkv_hit_tokens_total") >= HIT
    assert loaded["tokens"] == computed["tokens"]

"""Run vLLM's OpenAI server with tierkv as its KV connector, and talk to it as a client would.

Used by ``make run`` (``examples/``), the benchmarks in ``tools/`` and the tests. The server is
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of the CPU build does
not start); :func:`serve_command` is the exact command line, which the README shows.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ChatReply", "VllmServer", "connector_config", "free_port", "serve_command"]

READY_TIMEOUT_S = 300.0
BLOCK_TOKENS = 128  # vLLM's KV block size on the CPU


def connector_config(socket_path: str | None) -> dict[str, Any]:
    """The ``--kv-transfer-config`` that makes vLLM use tierkv (``socket_path`` None: no connector)."""
    return {"kv_connector": "TierKVConnector", "kv_connector_module_path": "tierkv.integrations.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": {"socket": socket_path}}


def serve_command(model_dir: str, port: int, kv_transfer: dict[str, Any] | None, *, name: str = "model",
                  max_model_len: int = 4096, num_blocks: int | None = None, prefix_caching: bool = True,
                  extra: list[str] | None = None, dtype: str = "float32") -> list[str]:
    """The command line of vLLM's OpenAI server on the CPU (float32 unless ``dtype``, eager) for ``model_dir``."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
           "--enforce-eager", "--max-model-len", str(max_model_len), "--enable-prompt-tokens-details"]
    if not prefix_caching:
        cmd.append("--no-enable-prefix-caching")
    if num_blocks is not None:
        cmd += ["--num-gpu-blocks-override", str(num_blocks)]
    if kv_transfer is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer)]
    return cmd + list(extra or [])


def free_port() -> int:
    """A TCP port on the loopback that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ChatReply:
    """One streamed chat completion as the client saw it."""

    text: str
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class VllmServer:
    """A vLLM OpenAI server subprocess on the loopback.

    Args:
        model_dir: the model directory.
        socket: the tierkv daemon's socket (None: vLLM without the connector).
        log_path: where the server's output goes.
        kv_cache_gib: vLLM's CPU KV cache size (``VLLM_CPU_KVCACHE_SPACE``).
        num_blocks: vLLM KV blocks (overrides the size, for a deliberately small cache).
        connector: a ``--kv-transfer-config`` other than tierkv's (e.g. vLLM's ExampleConnector).
        env: extra environment.
        dtype: the model's dtype (``--dtype``).
        args: more server arguments (e.g. ``["--tensor-parallel-size", "2"]``).
        one_process: run vLLM's engine core in the API server's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
            a start about 7 s shorter on 2 cores; the scheduler's connector then hands its metadata to the
            workers without crossing a process (the default keeps vLLM's own topology).
    """

    model_dir: str
    socket: str | None
    log_path: Path
    kv_cache_gib: int = 1
    num_blocks: int | None = None
    connector: dict[str, Any] | None = None
    prefix_caching: bool = True
    env: dict[str, str] = field(default_factory=dict)
    name: str = "model"
    port: int = 0
    proc: subprocess.Popen | None = None
    dtype: str = "float32"
    args: list[str] = field(default_factory=list)  # more server arguments (``--tensor-parallel-size 2``)
    one_process: bool = False

    def command(self) -> list[str]:
        """The server's command line."""
        kv = self.connector if self.connector is not None else (
            connector_config(self.socket) if self.socket else None)
        # vLLM sizes its check of max_model_len from memory, not from the block count: leave it a block.
        max_len = 4096 if self.num_blocks is None else (self.num_blocks - 1) * BLOCK_TOKENS
        return serve_command(self.model_dir, self.port, kv, name=self.name, num_blocks=self.num_blocks,
                             prefix_caching=self.prefix_caching, max_model_len=max_len, dtype=self.dtype,
                             extra=self.args)

    def start(self, wait: bool = True) -> VllmServer:
        """Start the server (on a fresh port unless one is set) and wait until it answers; a server
        already running is left as it is (``with VllmServer(...).start()`` starts one server)."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.port = self.port or free_port()
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
                   VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib), VLLM_NO_USAGE_STATS="1", **self.env)
        # vLLM's CPU build reserves a core for itself with a KV connector and not without one; the same
        # explicit binding (every core) for every server keeps servers with and without one comparable.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
        if self.one_process:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        if wait:
            self.wait_ready()
        return self

    @property
    def url(self) -> str:
        """The server's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Wait until ``/health`` answers 200.

        Raises:
            RuntimeError: the server exited or did not answer in time (the log's tail says why).
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited while starting; log {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM did not answer within {timeout:.0f} s; log {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        """The last ``n`` lines of the server's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 60.0) -> int | None:
        """Stop the server (SIGTERM: it shuts its engine down; SIGKILL to the group if it hangs)."""
        if self.proc is None:
            return None
        proc, self.proc = self.proc, None
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the engine outlived the server
        except (ProcessLookupError, PermissionError):
            pass
        return rc if rc is not None else proc.wait(30.0)

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 300.0) -> dict[str, Any]:
        """POST JSON to the server; returns the decoded JSON reply."""
        req = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = r.read()
        return json.loads(data) if data else {}

    def chat(self, messages: list[dict[str, str]], *, max_tokens: int = 32, salt: str | None = None,
             timeout: float = 300.0, extra: dict[str, Any] | None = None) -> ChatReply:
        """A streamed, greedy chat completion; TTFT is taken at the first content token. ``extra``: more
        request fields (e.g. vLLM's ``ignore_eos``)."""
        body: dict[str, Any] = {"model": self.name, "messages": messages, "max_tokens": max_tokens,
                                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        if salt:
            body["cache_salt"] = salt
        body.update(extra or {})
        req = urllib.request.Request(self.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        ttft: float | None = None
        parts: list[str] = []
        usage: dict[str, Any] = {}
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        parts.append(piece)
                usage = event.get("usage") or usage
        total = time.perf_counter() - t0
        details = usage.get("prompt_tokens_details") or {}
        return ChatReply("".join(parts), ttft if ttft is not None else total, total,
                         int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens") or 0),
                         int(usage.get("completion_tokens", 0)))

    def complete(self, prompt: list[int] | None, *, max_tokens: int = 8, logprobs: int = 1, salt: str | None = None,
                 timeout: float = 300.0, model: str | None = None, extra: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
        """A greedy completion of token ids: ``tokens`` (the generated ids), ``logprobs`` (of each, by the
        model), ``prompt_tokens`` and ``cached_tokens`` (served from vLLM's own cache or tierkv). ``salt``:
        vLLM's ``cache_salt`` (no block stored under another salt is reused); ``model``: the served model
        or LoRA adapter to ask (default the server's name); ``extra``: more request fields (with
        ``prompt_embeds`` in them, ``prompt`` may be None)."""
        body: dict[str, Any] = {"model": model or self.name, "max_tokens": max_tokens, "temperature": 0.0,
                                "logprobs": logprobs, "return_tokens_as_token_ids": True}
        if prompt is not None:
            body["prompt"] = list(prompt)
        if salt:
            body["cache_salt"] = salt
        body.update(extra or {})
        reply = self.post("/v1/completions", body, timeout=timeout)
        choice, usage = reply["choices"][0], reply.get("usage") or {}
        lp = choice.get("logprobs") or {}
        return {"tokens": [int(t.split(":", 1)[1]) for t in lp.get("tokens") or []],
                "logprobs": [float(x) for x in lp.get("token_logprobs") or []],
                "prompt_tokens": int(usage.get("prompt_tokens", 0)),
                "cached_tokens": int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)}

    def metric(self, name: str) -> float:
        """The sum of every series of ``name`` on the server's ``/metrics`` (0 when absent)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.split("{")[0].split(" ")[0] == name)

    def tokenize(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt token ids of a chat (vLLM's ``/tokenize``)."""
        return list(self.post("/tokenize", {"model": self.name, "messages": messages})["tokens"])

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's own prefix cache (needs ``VLLM_SERVER_DEV_MODE=1``)."""
        self.post("/reset_prefix_cache")

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

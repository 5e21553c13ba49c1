"""The serving benchmark's workloads (the working set and the requests a cache beside vLLM's can speed up) and its
report of the longest gaps between tokens."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from _serving_workloads import Workload, chat


def row(t: int, ids: list[str]) -> dict:
    return {"timestamp": t, "input_length": 128 * len(ids), "output_length": 4, "hash_ids": ids}


def test_reusable_are_requests_whose_prefix_outlived_a_small_lru():
    """Three blocks of LRU: request 2 repeats request 0's prefix after request 1 pushed it out (a cache
    beside vLLM's helps); request 3 repeats request 2's, still held (vLLM's own cache suffices)."""
    wl = Workload("t", [row(0, ["a", "b"]), row(1, ["c", "d"]), row(2, ["a", "b", "e"]), row(3, ["a", "b"])], 128)
    assert wl.working_set_blocks() == 5
    assert wl.reusable(3) == [2]
    assert wl.reusable(8) == []


def test_block_names_follow_prefixes_not_ids():
    """With 64-token ids a 128-token block is named by the two ids that end it and every id before them."""
    wl = Workload("t", [row(0, ["x", "a", "b", "c"]), row(1, ["y", "a", "b", "c"])], 64)
    wl.rows = [{**r, "input_length": 256} for r in wl.rows]
    assert wl.working_set_blocks() == 4
    assert wl.reusable(0) == []


def test_chat_turns_after_a_long_think_time_need_a_second_cache():
    wl = chat(96, 0.3)
    some = wl.reusable(32)
    assert 0 < len(some) < len(wl.rows)
    assert set(some) <= set(range(len(wl.rows)))
    assert len(wl.reusable(10_000)) == 0


def test_longer_conversations_and_clipping():
    """More turns per conversation make more of the requests reusable; every request fits ``max_len``."""
    four, eight = chat(128, 0.3), chat(128, 0.3, mean_turns=8, max_len=31 * 128)
    assert len(eight.reusable(32)) > len(four.reusable(32))
    assert max(r["input_length"] + r["output_length"] for r in eight.rows) <= 31 * 128
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 128) for r in eight.rows)


def test_the_benchmark_refuses_fewer_than_one_turn_per_conversation_in_one_line():
    tool = Path(__file__).resolve().parents[2] / "tools" / "bench_serving.py"
    out = subprocess.run([sys.executable, str(tool), "--chat-turns", "0.5"], capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "at least 1 turn per conversation" in out.stderr


def test_the_longest_gaps_are_tied_to_the_step_that_prefilled_another_request():
    from _serving_report import tail_gaps

    # request 0 decodes from t=1.0; request 1's first token at 1.5 ends request 0's long gap (0.4 s);
    # request 2's first token comes at 3.0, when no gap ends
    client = {"start_times": [0.0, 1.0, 2.5], "ttfts": [1.0, 0.5, 0.5],
              "itls": [[0.05, 0.05, 0.4, 0.05], [0.05, 0.05], [0.05]]}
    got = tail_gaps(client, reusable={1}, share=0.01)
    assert got == {"gaps": 1, "mean_ms": 400.0, "on_prefill": 1, "on_reusable": 1}
    assert tail_gaps(client, reusable=set(), share=0.01)["on_reusable"] == 0
    two = tail_gaps(client, reusable={1}, share=0.3)  # 2 of 7 gaps: the 0.4 s one and a 0.05 s one
    assert two["gaps"] == 2 and two["on_prefill"] >= 1


def test_a_report_that_is_missing_or_not_a_saved_run_is_refused_in_one_line(tmp_path):
    tools = Path(__file__).resolve().parents[2] / "tools"
    (tmp_path / "list.json").write_text("[]")
    for tool in ("bench_serving.py", "bench_pd.py"):
        for given, said in ((tmp_path / "none.json", "cannot read a saved run"),
                            (tmp_path / "list.json", "not a saved run")):
            out = subprocess.run([sys.executable, str(tools / tool), "--report", str(given)],
                                 capture_output=True, text=True)
            assert out.returncode == 1 and "Traceback" not in out.stderr
            assert said in out.stderr

"""The serving benchmark's workloads: the working set and the requests a cache beside vLLM's can speed up."""

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

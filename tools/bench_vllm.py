"""vLLM serving a multi-turn workload through its OpenAI API: vLLM alone, vLLM + its ExampleConnector,
vLLM + tierkv, in one run.

Workload: N conversations x T turns sharing one system prompt; each conversation opens with its own
member file (about 800 tokens, as a RAG document or a long first message would be), later turns ask
short questions. Turns are sent round-robin (turn 1 of every conversation, then turn 2, ...) by one
streaming client, so vLLM's own KV cache (kept small with ``--num-gpu-blocks-override``) cannot hold
them all. Then the server restarts and every conversation
sends one more turn. Then a workload with no reuse at all (a different system prompt per request).

Per configuration and phase: TTFT p50/p99 (first content token, as the client sees it), requests/s,
and prompt tokens vLLM reported as cached; each configuration's ratios to vLLM alone in the same run:
warm-turn TTFT p50 (turns 2.. and the turn after the restart) and requests/s on the no-reuse workload.

    python tools/bench_vllm.py                       # 16 conversations x 4 turns
    python tools/bench_vllm.py --conversations 4 --turns 2 --no-reuse 4   # a quick look
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _benchd import Daemon
from _demo_model import ensure_converted
from _vllm_server import ChatReply, VllmServer

SYSTEM = ("You are the help desk of the Harbour Street Tool Library. Answer in one short sentence. "
          + " ".join(f"Rule {i}: a member may borrow up to {i % 5 + 1} tools of shelf {i} for {i % 7 + 2} days."
                     for i in range(8)))
CONDITIONS = ["clean", "scratched", "oiled", "dusty", "as new", "worn"]
QUESTIONS = ["How do I join?", "What does a drill cost to borrow?", "Can I extend a loan?",
             "What if I break something?", "Do you repair toasters?", "Can I donate a saw?"]
USERS = ["Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea", "Mo", "Nia",
         "Omar", "Pia", "Quin", "Rosa", "Sven", "Tomo", "Uma", "Vik", "Wen", "Xia"]
VLLM_BLOCKS = 24  # vLLM's own cache: 24 x 128 tokens, a few conversations' worth


@dataclass
class Phase:
    """One phase's requests."""

    name: str
    replies: list[ChatReply] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict[str, float]:
        ttft = sorted(r.ttft_s for r in self.replies)
        p99 = ttft[min(len(ttft) - 1, int(round(0.99 * (len(ttft) - 1))))] if ttft else 0.0
        prompt = sum(r.prompt_tokens for r in self.replies)
        return {"requests": len(self.replies), "ttft_p50_s": statistics.median(ttft) if ttft else 0.0,
                "ttft_p99_s": p99, "requests_per_s": len(self.replies) / self.wall_s if self.wall_s else 0.0,
                "prompt_tokens": prompt, "cached_tokens": sum(r.cached_tokens for r in self.replies),
                "cached_fraction": sum(r.cached_tokens for r in self.replies) / prompt if prompt else 0.0}


def member_file(c: int) -> str:
    """Conversation ``c``'s own document: about 800 tokens no other conversation shares."""
    name = f"{USERS[c % len(USERS)]}-{c}"
    return f"Member file of {name}: " + " ".join(
        f"Loan {k}: {name} took tool {(c * 37 + k * 11) % 97} on day {k * 3 + c}, back on day {k * 3 + c + 4}, "
        f"{CONDITIONS[(c + k) % len(CONDITIONS)]}." for k in range(32))


def conversation_turns(convs: int, turns: int):
    """Round-robin (conversation, messages) with replies filled in as they come."""
    history = [[{"role": "system", "content": SYSTEM}] for _ in range(convs)]
    for t in range(turns):
        for c in range(convs):
            q = QUESTIONS[(c + t) % len(QUESTIONS)]
            intro = member_file(c) + " " if t == 0 else ""
            history[c].append({"role": "user", "content": f"{intro}I am {USERS[c % len(USERS)]}. {q}"})
            yield t, c, history[c]


def run_phase(server: VllmServer, name: str, requests, max_tokens: int) -> Phase:
    phase = Phase(name)
    t0 = time.perf_counter()
    for _turn, _conv, messages in requests:
        r = server.chat(messages, max_tokens=max_tokens)
        messages.append({"role": "assistant", "content": r.text})
        phase.replies.append(r)
    phase.wall_s = time.perf_counter() - t0
    return phase


def run_config(name: str, server: VllmServer, args: argparse.Namespace) -> dict[str, dict]:
    print(f"[{name}] starting vLLM ...", flush=True)
    server.start()
    out: dict[str, dict] = {}
    try:
        server.chat([{"role": "user", "content": "warm up"}], max_tokens=2)
        reqs = list(conversation_turns(args.conversations, args.turns))
        first = run_phase(server, "turn1", [r for r in reqs if r[0] == 0], args.max_tokens)
        warm = run_phase(server, "warm", [r for r in reqs if r[0] > 0], args.max_tokens)
        server.stop()
        server.start()
        server.chat([{"role": "user", "content": "warm up"}], max_tokens=2)
        convs = {c: m for _t, c, m in reqs}
        for c, m in convs.items():
            m.append({"role": "user", "content": f"I am back after a break. {QUESTIONS[c % len(QUESTIONS)]}"})
        restart = run_phase(server, "after_restart", [(args.turns, c, m) for c, m in convs.items()], args.max_tokens)
        noreuse = run_phase(server, "no_reuse", [
            (0, i, [{"role": "system", "content": f"Request {i}: " + SYSTEM.replace("Rule", f"R{i}-rule")},
                    {"role": "user", "content": "Summarise rule 3."}]) for i in range(args.no_reuse)], args.max_tokens)
        for p in (first, warm, restart, noreuse):
            out[p.name] = p.summary()
            s = out[p.name]
            print(f"[{name}] {p.name:13s} {s['requests']:3d} req  TTFT p50 {s['ttft_p50_s'] * 1e3:7.0f} ms  "
                  f"p99 {s['ttft_p99_s'] * 1e3:7.0f} ms  {s['requests_per_s']:.3f} req/s  "
                  f"cached {s['cached_fraction'] * 100:5.1f}% of {s['prompt_tokens']} prompt tokens", flush=True)
    finally:
        server.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--no-reuse", type=int, default=16, help="requests of the no-reuse workload")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--configs", default="vllm,example,tierkv")
    ap.add_argument("--out", default="bench-results/bench_vllm.json")
    args = ap.parse_args()
    model = str(ensure_converted())
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    results: dict[str, dict] = {}
    try:
        for cfg in args.configs.split(","):
            common = dict(log_path=work / f"{cfg}.log", num_blocks=VLLM_BLOCKS)
            if cfg == "vllm":
                results[cfg] = run_config(cfg, VllmServer(model, None, **common), args)
            elif cfg == "example":
                kv = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"shared_storage_path": str(work / "example")}}
                results[cfg] = run_config(cfg, VllmServer(model, None, connector=kv, **common), args)
            elif cfg == "tierkv":
                daemon = Daemon(work / "tierkv-data", str(work / "tierkv.sock"),
                                ["--host-capacity", "2GiB", "--disk-capacity", "8GiB"]).start()
                try:
                    results[cfg] = run_config(cfg, VllmServer(model, str(work / "tierkv.sock"), **common), args)
                finally:
                    daemon.stop()
            else:
                raise SystemExit(f"unknown config {cfg!r}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(results, args)


def report(results: dict[str, dict], args: argparse.Namespace) -> None:
    base = results.get("vllm")
    if base:
        print("\nratios against vLLM alone (same run):")
        for cfg, phases in results.items():
            if cfg == "vllm":
                continue
            w = phases["warm"]["ttft_p50_s"] / base["warm"]["ttft_p50_s"]
            r = phases["after_restart"]["ttft_p50_s"] / base["after_restart"]["ttft_p50_s"]
            q = phases["no_reuse"]["requests_per_s"] / base["no_reuse"]["requests_per_s"]
            print(f"  {cfg:8s} warm-turn TTFT p50 {w:.2f}x   after-restart TTFT p50 {r:.2f}x   "
                  f"no-reuse requests/s {q:.2f}x")
            phases["ratios"] = {"warm_ttft_p50": w, "after_restart_ttft_p50": r, "no_reuse_requests_per_s": q}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

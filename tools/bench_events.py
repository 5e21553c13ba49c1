"""KV events under load: the event rate and lag a subscriber sees, and what publishing costs the stores.

Clients put chains of blocks with their token ids (Llama-3-8B blocks of 16 tokens, real KV bytes) into
a daemon whose host tier is a quarter of what they store, so the host tier evicts and the disk tier
writes and evicts while they store. The same load runs twice in one invocation: events off (the
reference) and events on with a subscriber (`tierkv.client.events.EventIndex`) rebuilding the index.
Reported (the median of ``--repeats`` alternating runs): stored blocks/s of both and their ratio, events/s, batches/s, the subscriber's lag from
a batch's timestamp to its arrival (p50/p99/max) and the daemon's own lag from a change to its batch,
and whether the index matches `tierkv stats` at the end.

    python tools/bench_events.py                      # 4 clients, 16 chains of 8 blocks each (1 GiB)
    python tools/bench_events.py --clients 2 --chains 8 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from _bench_common import LLAMA, kv_blocks
from _benchd import Daemon

import tierkv
from tierkv.client.admin import request
from tierkv.client.events import EventIndex

MEDIA = {"gpu": "GPU", "host": "CPU", "disk": "DISK", "remote": "REMOTE"}


def load(sock: str, clients: int, chains: int, blocks: int, seed: int) -> float:
    """Every client puts ``chains`` chains of ``blocks`` blocks with token ids; returns seconds."""
    data = kv_blocks(blocks)

    def run(i: int) -> None:
        rng = np.random.default_rng(seed * 100 + i)
        with tierkv.Client.connect(sock, model="bench-events", layout=LLAMA) as c:
            for _ in range(chains):
                toks = rng.integers(0, 128_000, blocks * LLAMA.block_tokens)
                c.put(c.block_keys(toks), data, tokens=toks)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def one_run(work: Path, args: argparse.Namespace, events: bool) -> dict:
    sock = str(work / f"s-{int(events)}")
    total = args.clients * args.chains * args.blocks * LLAMA.block_bytes
    flags = ["--host-capacity", str(max(total // 4, 64 << 20)), "--disk-capacity", str(total // 2)]
    ep, rep = f"ipc://{work}/ev", f"ipc://{work}/replay"
    if events:
        flags += ["--kv-events", ep, "--kv-events-replay", rep]
    d = Daemon(work / f"data-{int(events)}", sock, flags).start()
    index = EventIndex(ep, replay=rep).start() if events else None
    try:
        secs = load(sock, args.clients, args.chains, args.blocks, args.seed)
        out: dict = {"seconds": round(secs, 3), "blocks_per_s": round(args.clients * args.chains * args.blocks / secs, 1)}
        if index is not None:
            match = False
            for _ in range(100):  # settle: the writer finishes, the last batches arrive
                tiers = request(sock, "STATS")["tiers"]
                want = {MEDIA[t]: v["blocks"] for t, v in tiers.items() if v["blocks"]}
                if want == {m: n for m, n in index.counts().items() if n}:
                    match = True
                    break
                time.sleep(0.2)
            ev = request(sock, "STATS")["events"]
            lag = sorted(index.lag_s) or [0.0]
            out.update(events=index.events, batches=index.batches, events_per_s=round(index.events / secs, 1),
                       batches_per_s=round(index.batches / secs, 1),
                       sub_lag_ms_p50=round(1000 * statistics.median(lag), 2),
                       sub_lag_ms_p99=round(1000 * lag[int(0.99 * (len(lag) - 1))], 2),
                       sub_lag_ms_max=round(1000 * lag[-1], 2), daemon_lag_ms_max=ev["lag_ms_max"],
                       index_matches_stats=match, gaps=index.gaps)
        return out
    finally:
        if index is not None:
            index.close()
        d.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--chains", type=int, default=16, help="chains per client")
    ap.add_argument("--blocks", type=int, default=8, help="blocks per chain")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each, alternating; the median is reported")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    offs, ons = [], []
    for _ in range(args.repeats):
        for events, runs in ((False, offs), (True, ons)):
            with tempfile.TemporaryDirectory(prefix="bench-events-") as tmp:
                runs.append(one_run(Path(tmp), args, events))
    off = sorted(offs, key=lambda x: x["blocks_per_s"])[len(offs) // 2]
    on = sorted(ons, key=lambda x: x["blocks_per_s"])[len(ons) // 2]
    on["index_matches_stats"] = all(x["index_matches_stats"] for x in ons)
    res = {"off": off, "on": on, "store_rate_on_vs_off": round(on["blocks_per_s"] / off["blocks_per_s"], 3),
           "block_bytes": LLAMA.block_bytes, "clients": args.clients, "stored_blocks": args.clients * args.chains * args.blocks}
    if args.json:
        print(json.dumps(res, indent=1))
        return
    print(f"{res['stored_blocks']} blocks of {LLAMA.block_bytes >> 20} MiB from {args.clients} clients")
    print(f"events off: {off['blocks_per_s']} blocks/s; on: {on['blocks_per_s']} blocks/s "
          f"(ratio {res['store_rate_on_vs_off']})")
    print(f"events: {on['events']} ({on['events_per_s']}/s) in {on['batches']} batches ({on['batches_per_s']}/s); "
          f"subscriber lag p50 {on['sub_lag_ms_p50']} ms, p99 {on['sub_lag_ms_p99']} ms, max {on['sub_lag_ms_max']} ms; "
          f"daemon lag max {on['daemon_lag_ms_max']} ms; index matches stats: {on['index_matches_stats']}")


if __name__ == "__main__":
    main()

"""Benchmark the cold-tier codecs on the real KV sample, beside plain zstd on the same bytes.

Frames are tierkv blocks: 16 tokens x 30 layers x 3 kv heads x 64 x K/V of SmolLM2-135M (368,640 B in a
16-bit dtype), 64 blocks for the 1,024-token sample. bf16 is made from the float16 sample by casting
through float32 (as a serving stack holding bf16 would); fp16 is the sample as stored.

Per codec: ratio (raw bytes / encoded bytes, container included), compress and decompress MB/s of raw
bytes (1 MB = 1e6 B; best of --reps passes, all cases interleaved in each pass) per core (CPU time of the
one encoding thread, so other processes on a shared machine do not count) and with --threads worker
threads (aggregate wall-clock throughput, and its scaling over one thread's wall-clock throughput),
and for lossy codecs the relative RMSE of K and V and the cosine similarity of attention outputs
computed with the model's real queries (recorded once from SmolLM2 and cached; --queries keys uses the
keys themselves as queries when the model is not installed). References in the same run: plain zstd
levels 1 and 3 on the raw block bytes (bare zstandard calls, no container, no checksum).

    python tools/bench_codecs.py [--json bench-results/bench_codecs.json] [--reps 5] [--threads 2]
                                 [--queries model|keys] [--dtypes bfloat16 float16]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import zstandard

from tierkv.codecs import decode_block, encode_block, read_header
from tierkv.core.keys import Namespace
from tierkv.core.layout import Layout

REPO = Path(__file__).resolve().parents[1]
SAMPLE_CANDIDATES = (os.environ.get("TIERKV_KV_SAMPLE"), REPO.parent / "shared/data/kv-sample",
                     REPO / "shared/data/kv-sample", Path("/work/shared/data/kv-sample"))
KEY = b"bench-key-000001"

# (label, codec, options); level 1 everywhere (the default).
CODECS = [
    ("raw", "raw", {}),
    ("zstd (container)", "zstd", {}),
    ("lossless", "lossless", {}),
    ("lossless channel-major", "lossless", {"lossless_channel_major": True}),
    ("fp8", "fp8", {}),
    ("int8", "int8", {}),
    ("int4", "int4", {}),
]


def sample_dir(arg: str | None) -> Path:
    for cand in (arg, *SAMPLE_CANDIDATES):
        if cand and (Path(cand) / "k.npy").exists():
            return Path(cand)
    raise SystemExit("kv-sample not found: pass --sample DIR or set TIERKV_KV_SAMPLE")


def make_blocks(kv: torch.Tensor, dtype: str, block_tokens: int) -> tuple[Layout, list[np.ndarray]]:
    layout = Layout(kv.shape[1], kv.shape[2], kv.shape[4], block_tokens, dtype)
    t = kv.to(layout.torch_dtype)
    blocks = [t[:, :, :, s:s + block_tokens].contiguous().view(torch.uint8).numpy().reshape(-1)
              for s in range(0, kv.shape[3] - block_tokens + 1, block_tokens)]
    return layout, blocks


# --- timing ---------------------------------------------------------------------------------------------

def one_pass(fn: Callable[[object], object], items: list, threads: int,
             pool: ThreadPoolExecutor | None) -> tuple[float, float]:
    """(CPU seconds of this thread, wall seconds) for one pass of ``fn`` over ``items``; with
    ``threads`` > 1 the pass is split across that many workers and the CPU figure is not measured."""
    if threads <= 1:
        c0, t0 = time.thread_time(), time.perf_counter()
        for it in items:
            fn(it)
        return time.thread_time() - c0, time.perf_counter() - t0
    barrier = threading.Barrier(threads)

    def run(chunk):
        barrier.wait()
        start = time.perf_counter()
        for it in chunk:
            fn(it)
        return start, time.perf_counter()

    spans = [f.result() for f in [pool.submit(run, items[i::threads]) for i in range(threads)]]
    return float("nan"), max(e for _, e in spans) - min(s for s, _ in spans)


def measure(cases: list[dict], reps: int, threads: int) -> None:
    """Best-of-``reps`` MB/s for every case; cases are interleaved within each rep so that load from
    other processes hits the references and the codecs alike."""
    with ThreadPoolExecutor(max(threads, 1)) as pool:
        for n_threads in (1, threads):
            best = {(i, op): [float("inf"), float("inf")] for i in range(len(cases)) for op in ("comp", "dec")}
            for _ in range(reps):
                for i, c in enumerate(cases):
                    for op, fn, items in (("comp", c["enc"], c["items"]), ("dec", c["dec"], c["frames"])):
                        cpu, wall = one_pass(fn, items, n_threads, pool)
                        b = best[(i, op)]
                        b[0], b[1] = min(b[0], cpu), min(b[1], wall)
            for i, c in enumerate(cases):
                for op in ("comp", "dec"):
                    cpu, wall = best[(i, op)]
                    if n_threads == 1:
                        c["row"][f"{op}_MBps"] = c["total"] / cpu / 1e6  # per core
                        c["row"][f"{op}_MBps_wall1"] = c["total"] / wall / 1e6
                    else:
                        c["row"][f"{op}_MBps_threads"] = c["total"] / wall / 1e6
                        c["row"][f"{op}_thread_scaling"] = c["row"][f"{op}_MBps_wall1"] and (
                            c["total"] / wall / 1e6 / c["row"][f"{op}_MBps_wall1"])


_tl = threading.local()


def plain_zstd(level: int):
    """Bare zstandard compress/decompress with per-thread contexts (the reference)."""
    def cctx():
        c = getattr(_tl, f"c{level}", None)
        if c is None:
            c = zstandard.ZstdCompressor(level=level)
            setattr(_tl, f"c{level}", c)
        return c

    def dctx():
        d = getattr(_tl, "d", None)
        if d is None:
            d = _tl.d = zstandard.ZstdDecompressor()
        return d

    def comp(b):
        return cctx().compress(b)

    def dec(f):
        return dctx().decompress(f)

    return comp, dec


# --- quality --------------------------------------------------------------------------------------------

def rel_rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(((a - b).pow(2).mean() / a.pow(2).mean()).sqrt())


def attention_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention outputs [L, Hq, T, D] for queries [L, Hq, T, D] and K/V [L, Hkv, T, D] (GQA)."""
    group = q.shape[1] // k.shape[1]
    t = q.shape[2]
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    outs = []
    for layer in range(q.shape[0]):
        kk = k[layer].repeat_interleave(group, dim=0)
        vv = v[layer].repeat_interleave(group, dim=0)
        s = (q[layer] @ kk.transpose(-1, -2)) / q.shape[-1] ** 0.5
        outs.append(torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ vv)
    return torch.stack(outs)


def real_queries(sample: Path, k_ref: np.ndarray) -> np.ndarray | None:
    """Post-RoPE queries [L, 9, T, D] of the sample's token sequence, recorded from SmolLM2 (cached)."""
    ids = np.load(sample / "token_ids_kvseq.npy")
    tag = hashlib.sha256(ids.tobytes()).hexdigest()[:12]
    cache = Path.home() / ".cache" / "tierkv" / f"kv-sample-queries-{tag}.npy"
    if cache.exists():
        return np.load(cache)
    try:
        import _demo_model as tkmodel

        if not tkmodel.available():
            return None
        import transformers.models.llama.modeling_llama as llama
    except ImportError:
        return None
    print("recording real queries from SmolLM2 (once; cached in ~/.cache/tierkv) ...", flush=True)
    _, model = tkmodel.load_model(attn_implementation="sdpa")
    qs, ks = [], []
    original = llama.apply_rotary_pos_emb

    def capture(q, k, *args, **kwargs):
        qe, ke = original(q, k, *args, **kwargs)
        qs.append(qe[0].float().numpy().astype(np.float16))
        ks.append(ke[0].float().numpy().astype(np.float16))
        return qe, ke

    llama.apply_rotary_pos_emb = capture
    try:
        with torch.inference_mode():
            model(torch.tensor([ids.tolist()], dtype=torch.long), use_cache=False)
    finally:
        llama.apply_rotary_pos_emb = original
    q, k = np.stack(qs), np.stack(ks)
    # The recorded keys must be the sample's keys, or the queries belong to another sequence.
    err = rel_rmse(torch.from_numpy(k_ref.astype(np.float32)), torch.from_numpy(k.astype(np.float32)))
    if err > 1e-2:
        print(f"recorded keys differ from k.npy (rel RMSE {err:.3g}); not using model queries", file=sys.stderr)
        return None
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.save(cache, q)
    return q


# --- the benchmark --------------------------------------------------------------------------------------

def bench_dtype(kv: torch.Tensor, dtype: str, args, queries: torch.Tensor) -> dict:
    layout, blocks = make_blocks(kv, dtype, args.block_tokens)
    fp = Namespace("SmolLM2-135M-Instruct", layout).fingerprint
    total = layout.block_bytes * len(blocks)
    print(f"\n{dtype}: {len(blocks)} blocks of {layout.block_bytes} B ({args.block_tokens} tokens)", flush=True)
    n = args.threads
    head = (f"{'codec':24} {'ratio':>6} {'comp MB/s':>10} {'dec MB/s':>9} {f'comp {n}T':>8} {'scale':>5} "
            f"{f'dec {n}T':>8} {'scale':>5} {'rmse K':>8} {'rmse V':>8} {'attn cos':>9} {'p1':>7}")
    print(head)

    def report(row):
        lossy = "rmse_k" in row
        print(f"{row['name']:24} {row['ratio']:6.3f} {row['comp_MBps']:10.0f} {row['dec_MBps']:9.0f} "
              f"{row['comp_MBps_threads']:8.0f} {row['comp_thread_scaling']:5.2f} "
              f"{row['dec_MBps_threads']:8.0f} {row['dec_thread_scaling']:5.2f} "
              + (f"{row['rmse_k']:8.4f} {row['rmse_v']:8.4f} {row['attn_cos_mean']:9.5f} {row['attn_cos_p1']:7.4f}"
                 if lossy else ""), flush=True)

    cases = []
    for level in (1, 3):
        comp, dec = plain_zstd(level)
        frames = [comp(b) for b in blocks]
        row = {"name": f"plain zstd-{level}", "codec": None, "level": level, "reference": True,
               "ratio": total / sum(len(f) for f in frames)}
        cases.append({"row": row, "enc": comp, "dec": dec, "items": blocks, "frames": frames, "total": total})

    orig = torch.from_numpy(np.stack(blocks)).view(layout.torch_dtype).reshape(len(blocks), *layout.block_shape)
    orig_kv = torch.cat(list(orig), dim=3).float()  # [2, L, H, T, D]
    ref_out = attention_out(queries, orig_kv[0], orig_kv[1])
    for label, codec, options in CODECS:
        def enc(b, codec=codec, options=options):
            return encode_block(b, layout=layout, fingerprint=fp, key=KEY, codec=codec, **options)

        def dec(blob):
            return decode_block(blob, layout=layout, fingerprint=fp, key=KEY)

        blobs = [enc(b) for b in blocks]
        headers = [read_header(x) for x in blobs]
        row = {"name": label, "codec": codec, "options": options, "level": 1, "reference": False,
               "ratio": total / sum(len(x) for x in blobs), "stored_as": sorted({h.codec for h in headers})}
        back = [dec(x) for x in blobs]
        if all(h.checksum_scope == "raw" for h in headers):
            assert all(a.tobytes() == b.tobytes() for a, b in zip(back, blocks)), f"{label} not bit-exact"
        else:
            got = torch.from_numpy(np.stack(back)).view(layout.torch_dtype).reshape(orig.shape)
            got_kv = torch.cat(list(got), dim=3).float()
            cos = torch.nn.functional.cosine_similarity(ref_out, attention_out(queries, got_kv[0], got_kv[1]), dim=-1)
            row.update(rmse_k=rel_rmse(orig_kv[0], got_kv[0]), rmse_v=rel_rmse(orig_kv[1], got_kv[1]),
                       attn_cos_mean=float(cos.mean()), attn_cos_p1=float(cos.flatten().quantile(0.01)),
                       attn_cos_min=float(cos.min()))
        cases.append({"row": row, "enc": enc, "dec": dec, "items": blocks, "frames": blobs, "total": total})
    measure(cases, args.reps, args.threads)
    rows = [c["row"] for c in cases]
    for row in rows:
        report(row)
    return {"dtype": dtype, "block_bytes": layout.block_bytes, "blocks": len(blocks), "rows": rows}


def against_zstd1(result: dict) -> list[dict]:
    """bf16 figures of the cold-tier codecs, and their ratios to plain zstd-1 measured in the same run."""
    rows = {r["name"]: r for r in result["rows"]}
    z1, ll, i8, i4 = rows["plain zstd-1"], rows["lossless"], rows["int8"], rows["int4"]
    figures = [
        ("lossless ratio", ll["ratio"], "x"),
        ("lossless ratio / zstd-1 ratio", ll["ratio"] / z1["ratio"], "x"),
        ("lossless comp speed / zstd-1", ll["comp_MBps"] / z1["comp_MBps"], "x"),
        ("lossless dec speed / zstd-1", ll["dec_MBps"] / z1["dec_MBps"], "x"),
        ("int8 ratio", i8["ratio"], "x"),
        ("int8 rel RMSE (max of K, V)", max(i8["rmse_k"], i8["rmse_v"]), ""),
        ("int4 ratio", i4["ratio"], "x"),
        ("int4 attention-output cosine (mean)", i4["attn_cos_mean"], ""),
    ]
    return [{"name": name, "value": value, "unit": unit} for name, value, unit in figures]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=str(REPO / "bench-results" / "bench_codecs.json"))
    ap.add_argument("--sample", default=None, help="kv-sample folder (default: ../shared/data/kv-sample)")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--queries", choices=["model", "keys"], default="model",
                    help="attention queries: recorded from the model (falls back to keys if unavailable)")
    args = ap.parse_args()

    sample = sample_dir(args.sample)
    k = np.load(sample / "k.npy", mmap_mode="r")
    v = np.load(sample / "v.npy", mmap_mode="r")
    kv = torch.from_numpy(np.stack([k, v]).astype(np.float32))
    q_np = real_queries(sample, np.asarray(k)) if args.queries == "model" else None
    if q_np is not None:
        queries, q_source = torch.from_numpy(q_np.astype(np.float32)), "model (SmolLM2, post-RoPE, 9 heads)"
    else:
        queries, q_source = kv[0].clone(), "keys as queries (model not available)"
    print(f"zstandard {zstandard.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"queries: {q_source}")
    load_before = os.getloadavg()
    results = [bench_dtype(kv, dt, args, queries) for dt in args.dtypes]
    load_after = os.getloadavg()
    print(f"\nload average (1 min) before/after: {load_before[0]:.2f} / {load_after[0]:.2f} on {os.cpu_count()} CPUs"
          " (the thread-scaling columns are only meaningful on an otherwise idle machine)")

    summary = []
    bf = next((r for r in results if r["dtype"] == "bfloat16"), None)
    if bf is not None:
        summary = against_zstd1(bf)
        print("\nbf16, single thread, beside plain zstd-1 in this run:")
        for f in summary:
            print(f"  {f['name']:40} {f['value']:8.4f}{f['unit']:1}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": "python tools/bench_codecs.py " + " ".join(sys.argv[1:]),
        "sample": str(sample), "queries": q_source, "block_tokens": args.block_tokens, "reps": args.reps,
        "threads": args.threads, "zstandard": zstandard.__version__, "torch": torch.__version__,
        "python": platform.python_version(), "cpus": os.cpu_count(), "loadavg_before": load_before,
        "loadavg_after": load_after, "results": results, "bf16_vs_zstd1": summary,
    }, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

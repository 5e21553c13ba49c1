"""The lookup-latency benchmark: tierkv's LOOKUP beside an echo server and a plain-Python LOOKUP.

Used by bench_tiers.py (part e of its docstring).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np
import torch
from _bench_common import LLAMA
from _benchd import Daemon

import tierkv

LOOKUP_CONTENDERS = ("echo", "python", "socket", "tierkv")


def _roundtrip(s, request: bytes) -> bytes:
    """Send one frame and read one whole reply frame."""
    from tierkv.core import protocol

    s.sendall(request)
    buf = s.recv(4096)
    while len(buf) < protocol.HEADER_BYTES or len(buf) < protocol.HEADER_BYTES + int.from_bytes(buf[12:16], "little"):
        more = s.recv(4096)
        if not more:
            raise ConnectionError("reference server closed")
        buf += more
    return buf


def _contenders(tk_sock: str, ref_socks: dict[str, str], keys: list[bytes]) -> tuple[dict, list]:
    """The lookup call of each contender (see :func:`_lookup_worker`) and what to close afterwards."""
    import socket as _socket

    import msgpack

    from tierkv.core import protocol

    socks = {}
    for name, path in ref_socks.items():
        socks[name] = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        socks[name].connect(path)
    frame = protocol.pack(protocol.Op.LOOKUP, 1, {"keys": keys})

    def echo() -> int:
        _roundtrip(socks["echo"], frame)
        return len(keys)

    def python() -> int:
        payload = msgpack.packb({"keys": keys}, use_bin_type=True)
        reply = _roundtrip(socks["python"], protocol.HEADER.pack(b"TK", 1, 0, 6, 0, 1, len(payload)) + payload)
        return msgpack.unpackb(reply[protocol.HEADER_BYTES:])["count"]

    c = tierkv.Client.connect(tk_sock, model="bench", layout=LLAMA, populate=False)
    cs = tierkv.Client.connect(tk_sock, model="bench", layout=LLAMA, populate=False, lookup_index=False)
    assert c._index is not None, "the daemon passed no lookup index (tierkv._native._lookup not built?)"
    calls = {"echo": echo, "python": python, "socket": lambda: cs.lookup(keys), "tierkv": lambda: c.lookup(keys)}
    return calls, [c, cs, *socks.values()]


def _lookup_worker(tk_sock: str, ref_socks: dict[str, str], keys: list[bytes], n: int, rate: float, phases: int,
                   barrier, q) -> None:
    """Time ``n`` lookups against each contender, round-robin in ``phases`` phases that every client
    process starts together (a barrier), so all see the same load from the rest of the machine. ``rate``
    0: back-to-back (closed loop); else each client is paced at ``rate`` lookups/s with exponential gaps,
    like an engine's scheduler.

    - ``echo``: the bare transport: the same request frame (a LOOKUP of these keys, packed once) sent with
      one ``sendall`` to the echo server, its fixed small reply read with ``recv``;
    - ``python``: the same work written as plainly as Python allows, no tierkv code on either side: the
      client packs the request with msgpack and unpacks the reply, the server unpacks it, checks the
      keys and walks a dict of the 64 (fingerprint + key) entries;
    - ``socket``: ``Client.lookup`` answered by the daemon through the socket (``lookup_index=False``);
    - ``tierkv``: ``Client.lookup`` as users get it: from the daemon's shared lookup index."""
    calls, closers = _contenders(tk_sock, ref_socks, keys)
    lats: dict[str, list[float]] = {name: [] for name in LOOKUP_CONTENDERS}
    rng = np.random.default_rng(os.getpid())
    try:
        for _ in range(50):
            for call in calls.values():
                call()
        for phase in range(phases):
            name = LOOKUP_CONTENDERS[phase % len(LOOKUP_CONTENDERS)]
            barrier.wait(120)
            _timed_calls(calls[name], lats[name], n * len(LOOKUP_CONTENDERS) // phases, rate, rng, len(keys))
    finally:
        for x in closers:
            x.close()
    q.put(lats)


def _timed_calls(call, lat: list[float], count: int, rate: float, rng: np.random.Generator, want: int) -> None:
    """Append the latency of ``count`` calls to ``lat``, paced at ``rate``/s (0: back-to-back)."""
    nxt = time.perf_counter()
    for _ in range(count):
        if rate:
            nxt += rng.exponential(1.0 / rate)
            delay = nxt - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        t = time.perf_counter()
        got = call()
        lat.append(time.perf_counter() - t)
        assert got == want


def _ref_serve(conn, table: dict | None) -> None:
    """One connection of a reference server: read frames; ``table`` None: answer a fixed reply (echo);
    else unpack the body, check the keys and count the leading ones in ``table`` (the plain-Python LOOKUP)."""
    import msgpack

    from tierkv.core import protocol

    fixed = protocol.pack(protocol.Op.LOOKUP, 1, {"count": 64})
    fp = b"\1" * 16
    buf = bytearray()
    with conn:
        while True:
            while len(buf) < protocol.HEADER_BYTES:
                chunk = conn.recv(1 << 16)
                if not chunk:
                    return
                buf += chunk
            end = protocol.HEADER_BYTES + int.from_bytes(buf[12:16], "little")
            while len(buf) < end:
                chunk = conn.recv(1 << 16)
                if not chunk:
                    return
                buf += chunk
            if table is None:
                reply = fixed
            else:
                keys = msgpack.unpackb(bytes(buf[protocol.HEADER_BYTES:end]))["keys"]
                n = 0
                for k in keys:
                    if type(k) is not bytes or not 0 < len(k) <= 128:
                        raise ValueError("bad key")
                    if table.get(fp + k) is None:
                        break
                    n += 1
                body = msgpack.packb({"count": n})
                reply = protocol.HEADER.pack(b"TK", 1, 0, 6, 0, 1, len(body)) + body
            del buf[:end]
            conn.sendall(reply)


def _ref_server(path: str, keys: list[bytes] | None, ready) -> None:
    """A reference server: minimal Python, thread per connection, Unix socket (see :func:`_ref_serve`)."""
    import socket as _socket
    import threading

    table = None if keys is None else {b"\1" * 16 + k: object() for k in keys}
    lst = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    lst.bind(path)
    lst.listen(128)
    ready.set()
    while True:
        conn, _ = lst.accept()
        threading.Thread(target=_ref_serve, args=(conn, table), daemon=True).start()


LOOKUP_MODES = ((1, 0), (8, 0), (1, 500), (8, 500))


def _percentiles(lat: list[float]) -> dict:
    lat = sorted(lat)
    return {"p50_us": lat[len(lat) // 2] * 1e6, "p99_us": lat[int(len(lat) * 0.99)] * 1e6, "samples": len(lat)}


def lookup_bench(tmp: Path, blocks: torch.Tensor, n: int = 2000, phases: int = 12) -> dict:
    """tierkv's LOOKUP of 64 cached keys beside the two reference servers, in the same client processes,
    round-robin phase by phase (see :func:`_lookup_worker`)."""
    d = Daemon(tmp / "lk-data", str(tmp / "l.sock"), ["--host-capacity", "256MiB", "--no-disk"]).start()
    ctx = mp.get_context("spawn")
    refs: dict[str, str] = {}
    procs = []
    try:
        with tierkv.Client.connect(d.sock, model="bench", layout=LLAMA) as c:
            keys = c.block_keys(np.arange(64 * 16))
            c.put(keys, blocks[:64])  # every lookup walks 64 cached blocks
        for name in ("echo", "python"):
            ready = ctx.Event()
            refs[name] = str(tmp / f"{name}.sock")
            procs.append(ctx.Process(target=_ref_server, args=(refs[name], keys if name == "python" else None, ready),
                                     daemon=True))
            procs[-1].start()
            assert ready.wait(60), f"{name} server did not start"
        res = {}
        for nclients, rate in LOOKUP_MODES:
            name = f"{nclients} client{'s' if nclients > 1 else ''}, " + (f"paced {rate}/s each" if rate else "back-to-back")
            q, barrier = ctx.Queue(), ctx.Barrier(nclients)
            ps = [ctx.Process(target=_lookup_worker, args=(d.sock, refs, keys, n, rate, phases, barrier, q))
                  for _ in range(nclients)]
            for p in ps:
                p.start()
            got = [q.get(timeout=600) for _ in ps]
            for p in ps:
                p.join()
            res[name] = _percentiles([x for g in got for x in g["tierkv"]])
            for ref in ("echo", "python", "socket"):
                res[name][ref] = _percentiles([x for g in got for x in g[ref]])
                res[name][f"p99_vs_{ref}"] = res[name]["p99_us"] / res[name][ref]["p99_us"]
        return res
    finally:
        for p in procs:
            p.terminate()
            p.join(10)
        d.stop()

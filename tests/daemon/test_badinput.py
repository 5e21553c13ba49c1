"""Bad input against a live daemon: hostile frames, out-of-range slots, lease misuse.

Every case must end in an error reply or a closed connection, leave the daemon's state as it was and
its anonymous memory within 1 MB. Frames are written by hand (``RawClient``) so nothing on the client
side filters them. ``RawClient`` lives in ``tests/helpers.py``.
"""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers import (
    FAST_ENV,
    MAX_FRAME,
    SMALL,
    Daemon,
    RawClient,
    _send_and_close,
    block_values,
    quiet_sample,
    wait_for,
)
from tierkv.core import protocol
from tierkv.core.keys import Namespace
from tierkv.core.layout import Layout
from tierkv.core.protocol import HEADER, Op


# ---- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """One daemon for the module, with a few blocks stored by a normal client."""
    work = Path(tmp_path_factory.mktemp("badinput"))
    d = Daemon(work, env=FAST_ENV)
    d.start()
    c = d.client()
    keys = c.block_keys(np.arange(16 * 8))
    c.put(keys, block_values(keys))
    d.keys = keys  # type: ignore[attr-defined]
    d.normal = c  # type: ignore[attr-defined]
    yield d
    c.close()
    d.stop()
    assert "Exception in thread" not in d.log.read_text()  # no connection thread died


def state_of(d: Daemon) -> dict:
    """What bad input must not change: leases, host usage and blocks per tier."""
    st = d.stats()
    return {"leases": st["leases"], "host_used": st["tiers"]["host"]["used_bytes"],
            "host_blocks": st["tiers"]["host"]["blocks"], "disk_blocks": st["tiers"]["disk"]["blocks"]}


def settle(d: Daemon, before: dict) -> dict:
    """The state once the daemon has torn down every hand-driven connection (it should equal ``before``)."""
    wait_for(lambda: state_of(d) == before, timeout=10)
    return state_of(d)


def check_data(d: Daemon) -> None:
    """A normal client is still served what it stored, bit-exact."""
    got = d.normal.get(d.keys)  # type: ignore[attr-defined]
    want = block_values(d.keys)  # type: ignore[attr-defined]
    assert np.array_equal(got.view(torch.int16).numpy().view(np.uint16), want)


# ---- frame-level abuse -----------------------------------------------------------------------------
def _hdr(op: int = Op.PING, length: int = 0, version: int = protocol.VERSION, status: int = 0,
         magic: bytes = b"TK", rid: int = 1) -> bytes:
    return HEADER.pack(magic, version, 0, op, status, rid, length)


FATAL_FRAMES: dict[str, bytes] = {
    "length 4 GiB - 1": _hdr(length=0xFFFFFFFF),
    "length just over the cap": _hdr(length=MAX_FRAME + 1),
    "length negative as int32": _hdr(length=0x80000000),
    "length -1 as int32 with a body": _hdr(length=0xFFFFFFFF) + b"\x80" * 64,
    "bad magic": _hdr(magic=b"XX"),
    "version 0": _hdr(version=0),
    "version 2": _hdr(version=2),
    "version 255": _hdr(version=255),
    "status 1 in a request": _hdr(status=1),
    "garbage msgpack": _hdr(length=5) + b"\xc1\xc1\xc1\xc1\xc1",
    "msgpack ext type": _hdr(length=3) + b"\xd4\x05\x00",
    "nesting 100k deep": _hdr(length=100_000) + b"\x91" * 100_000,
    "array claiming 2^32-1 items": _hdr(length=5) + b"\xdd\xff\xff\xff\xff",
    "str claiming 2^32-1 bytes": _hdr(length=5) + b"\xdb\xff\xff\xff\xff",
    "trailing bytes after the body": _hdr(length=3) + b"\x80\x80\x80",
}

TRUNCATED_FRAMES: dict[str, bytes] = {
    "5 header bytes": _hdr()[:5],
    "header only, body of 100 promised": _hdr(length=100),
    "10 of 100 body bytes": _hdr(length=100) + b"\x01" * 10,
    "1 KiB of a 15 MiB body": _hdr(length=15 << 20) + b"\x00" * 1024,
}




def _assert_error_or_nothing(data: bytes, what: str) -> None:
    if not data:
        return
    op, status, _rid, length = protocol.parse_header(data[:16], MAX_FRAME)
    assert status == protocol.STATUS_ERROR, f"{what}: a reply that is not an error"
    body = protocol.unpack_body(data[16:16 + length], MAX_FRAME)
    assert body["code"] in ("protocol", "bad_request"), f"{what}: {body}"


@pytest.mark.parametrize("name", list(FATAL_FRAMES))
def test_fatal_frames_close_the_connection(live, name):
    before = state_of(live)
    data = _send_and_close(live.socket, FATAL_FRAMES[name])
    _assert_error_or_nothing(data, name)
    assert settle(live, before) == before


@pytest.mark.parametrize("name", list(TRUNCATED_FRAMES))
def test_truncated_frames(live, name):
    before = state_of(live)
    data = _send_and_close(live.socket, TRUNCATED_FRAMES[name])
    assert data == b"" or protocol.parse_header(data[:16], MAX_FRAME)[1] == protocol.STATUS_ERROR
    assert settle(live, before) == before


def test_oversize_frame_rejected_before_the_body_is_read(live):
    """The daemon answers a header claiming 4 GiB at once, without waiting for (or buffering) a body."""
    c = RawClient(live.socket, timeout=5)
    try:
        c.sock.sendall(_hdr(length=0xFFFFFFF0))  # no body follows, the connection stays open
        op, status, _rid, body = c.recv()
        assert status == protocol.STATUS_ERROR and "cap" in body["message"]
        assert c.read_to_eof() == b""  # then it closes
    finally:
        c.close()


def test_unknown_opcodes_are_errors_and_the_connection_survives(live):
    c = RawClient(live.socket)
    try:
        for op in (0, max(Op) + 1, 999, 0xFFFF):
            status, body = c.call(op, {})
            assert status == protocol.STATUS_ERROR and "opcode" in body["message"]
        assert c.ok(Op.PING)["pong"]
        # request ids are echoed, even duplicates; the daemon keeps no per-id state
        for rid in (7, 7, 0, 0xFFFFFFFF):
            c.send(Op.PING, {}, rid=rid)
            assert c.recv()[2] == rid
    finally:
        c.close()


# Bodies of the wrong shape for every opcode: each must get a reply (ok or error) on a live connection.
GARBAGE_BODIES: list[Any] = [
    None, [], 1, "x", b"\x00", {"keys": 5}, {"keys": [1, 2]}, {"keys": ["str"]}, {"keys": [b""]},
    {"keys": [b"k" * 129]}, {"keys": [[b"k"]]}, {"n": -1}, {"n": 2**63}, {"n": 1.5}, {"n": "3"},
    {"slots": 5}, {"slots": [[1]]}, {"slots": [{"a": 1}]}, {"slots": [-1]}, {"leases": [[1]]},
    {"leases": [-1, 2**64 - 1]}, {"keys": [b"k" * 16], "scores": [float("nan")]},
    {"keys": [b"k" * 16], "scores": [float("inf")]}, {"keys": [b"k" * 16], "scores": ["a"]},
    {"keys": [b"k" * 16], "slots": [0], "durable": "yes"}, {"keys": [b"k" * 16], "slots": [0], "remote": "yes"},
    {"namespace": 5},
    {"namespace": {"model": "m", "layout": {"num_layers": -1}}}, {"settings": {"no.such": 1}},
    {"budget": "x", "sinks": 1, "recent": 1}, {"keys": [b"k" * 16], "priority": 1000},
    {"keys": [b"k" * 16], "slots": [0], "chains": 5}, {"keys": [b"k" * 16], "slots": [0], "chains": [[0, 5]]},
]

# Opcodes that change settings or run long scrubs are exercised by their own tests.
_SKIP_OPS = {Op.TUNE, Op.VERIFY}


def _garbage_round(path: str, with_hello: bool) -> list[str]:
    """Every opcode x every garbage body; returns the internal errors seen."""
    internal: list[str] = []
    c = RawClient(path)
    try:
        if with_hello:
            assert c.hello(Namespace("test-model", SMALL))[0] == protocol.STATUS_OK
        for op in Op:
            if op in _SKIP_OPS:
                continue
            for body in GARBAGE_BODIES:
                if op == Op.HELLO:
                    status, reply = c.hello(body if isinstance(body, dict) else {"x": body})
                    if status == protocol.STATUS_OK:
                        continue
                else:
                    c.send(op, body)
                    _rop, status, _rid, reply = c.recv()
                if status == protocol.STATUS_ERROR and reply.get("code") == "error":
                    internal.append(f"{op.name} {body!r}: {reply['message']}")
        assert c.ok(Op.PING)["pong"]  # the connection survived all of it
    finally:
        c.close()
    return internal


def test_garbage_bodies_for_every_opcode_leave_state_unchanged(live):
    before = state_of(live)
    _garbage_round(live.socket, with_hello=False)
    _garbage_round(live.socket, with_hello=True)
    assert settle(live, before) == before
    check_data(live)


def test_garbage_bodies_never_cause_internal_errors(live):
    internal = _garbage_round(live.socket, with_hello=True) + _garbage_round(live.socket, with_hello=False)
    assert internal == []


# ---- slots, offsets and leases ---------------------------------------------------------------------
def test_slot_offsets_out_of_range(live):
    start = state_of(live)
    c = RawClient(live.socket)
    other = RawClient(live.socket)
    try:
        c.hello(Namespace("test-model", SMALL))
        other.hello(Namespace("test-model", SMALL))
        theirs = other.ok(Op.ALLOC, {"n": 1})["slots"][0]
        mine = c.ok(Op.ALLOC, {"n": 1})["slots"][0]
        before = state_of(live)
        cap = live.stats()["tiers"]["host"]["capacity_bytes"]
        key = [os.urandom(16)]
        for off in (-1, -(2**63), 2**63, 2**64 - 1, cap, cap + 4096, mine + 1, mine + 4096, theirs, None, 1.0,
                    "0", b"\x00"):
            status, reply = c.call(Op.COMMIT, {"keys": key, "slots": [off]})
            assert status == protocol.STATUS_ERROR and reply["code"] == "bad_request", (off, reply)
        for slots in ([mine, mine], [mine, theirs]):  # a duplicate, or someone else's slot beside ours
            status, reply = c.call(Op.COMMIT, {"keys": [os.urandom(16), os.urandom(16)], "slots": slots})
            assert status == protocol.STATUS_ERROR, slots
        # ALLOC sizes that cannot be met
        for n in (-1, 2**62, cap // 4096 + 1):
            status, reply = c.call(Op.ALLOC, {"n": n})
            assert status == protocol.STATUS_ERROR and reply["code"] == "bad_request", n
        # aborting slots we do not own frees nothing of theirs
        c.ok(Op.ABORT, {"slots": [theirs, -1, 2**63, cap]})
        assert state_of(live) == before
        # where chains start: increasing [index, parent] pairs within the keys, parent nil or a key
        for chains in (5, [5], [[0]], [[1, None]], [[-1, None]], [["0", None]], [[0, b""]], [[0, b"k" * 129]],
                       [[0, "k"]], [[0, None], [0, None]], [[0, None]] * 2, [[0.0, None]]):
            status, reply = c.call(Op.COMMIT, {"keys": key, "slots": [mine], "chains": chains})
            assert status == protocol.STATUS_ERROR and reply["code"] == "bad_request", (chains, reply)
        # whose quotas count the blocks: increasing [index, tenant] pairs, tenant nil or a short name
        for tenants in (5, [5], [[0]], [[1, "t"]], [[0, ""]], [[0, "t" * 257]], [[0, b"t"]], [[0, "t"], [0, "u"]]):
            status, reply = c.call(Op.COMMIT, {"keys": key, "slots": [mine], "tenants": tenants})
            assert status == protocol.STATUS_ERROR and reply["code"] == "bad_request", (tenants, reply)
        assert state_of(live) == before
        # ours still commits after all that
        assert c.ok(Op.COMMIT, {"keys": key, "slots": [mine], "chains": [[0, os.urandom(16)]]})["new"] == 1
        assert c.ok(Op.DELETE, {"keys": key})["deleted"] == 1
        other.ok(Op.ABORT, {"slots": [theirs]})
    finally:
        c.close()
        other.close()
    assert settle(live, start) == start
    check_data(live)


def test_bad_commit_flags_are_bad_requests_and_keep_the_slots(live):
    """``wait`` and ``remote`` are bools: anything else is refused before a block is published."""
    start = state_of(live)
    c = RawClient(live.socket)
    try:
        c.hello(Namespace("test-model", SMALL))
        mine = c.ok(Op.ALLOC, {"n": 1})["slots"][0]
        before = state_of(live)
        key = [os.urandom(16)]
        for name in ("wait", "remote"):
            for value in ("yes", 1, 0, None, 1.0, [True], {}, b"\x01"):
                status, reply = c.call(Op.COMMIT, {"keys": key, "slots": [mine], name: value})
                assert status == protocol.STATUS_ERROR and reply["code"] == "bad_request", (name, value, reply)
                assert name in reply["message"]
        assert state_of(live) == before
        # the slot is still ours; without a remote tier ``remote`` stores locally
        assert c.ok(Op.COMMIT, {"keys": key, "slots": [mine], "remote": True})["new"] == 1
        assert c.ok(Op.LOOKUP, {"keys": key, "tiers": True})["tiers"] == ["host"]
        assert c.ok(Op.DELETE, {"keys": key})["deleted"] == 1
    finally:
        c.close()
    assert settle(live, start) == start
    check_data(live)


def test_bad_keep_and_uses_are_bad_requests_and_keep_the_slots(live):
    """ALLOC's ``keep`` and COMMIT's ``uses`` are lists of keys: anything else is refused, no slot is
    handed out or lost, no block is published or counted, and the slot still commits."""
    start = state_of(live)
    c = RawClient(live.socket)
    try:
        c.hello(Namespace("test-model", SMALL))
        mine = c.ok(Op.ALLOC, {"n": 1})["slots"][0]
        before = state_of(live)
        key = [os.urandom(16)]
        for value in (5, "k", b"k", [b""], [None], [5], [b"k" * 129], {"k": 1}, [[b"k"]]):
            status, reply = c.call(Op.ALLOC, {"n": 1, "keep": value})
            assert status == protocol.STATUS_ERROR and reply["code"] == "bad_request", (value, reply)
            status, reply = c.call(Op.COMMIT, {"keys": key, "slots": [mine], "uses": value})
            assert status == protocol.STATUS_ERROR and reply["code"] == "bad_request", (value, reply)
        assert state_of(live) == before
        hits = live.stats()["tiers"]["host"]["hits"]
        assert c.ok(Op.COMMIT, {"keys": key, "slots": [mine], "uses": live.keys[:2]})["new"] == 1
        assert live.stats()["tiers"]["host"]["hits"] == hits  # a use is not a hit
        assert c.ok(Op.DELETE, {"keys": key})["deleted"] == 1
    finally:
        c.close()
    assert settle(live, start) == start
    check_data(live)


def test_lease_misuse_leaves_leases_unchanged(live):
    start = state_of(live)
    a = RawClient(live.socket)
    b = RawClient(live.socket)
    try:
        a.hello(Namespace("test-model", SMALL))
        b.hello(Namespace("test-model", SMALL))
        keys = live.keys[:4]
        la = a.ok(Op.ACQUIRE, {"keys": keys})["lease"]
        lb = b.ok(Op.ACQUIRE, {"keys": keys})["lease"]
        assert live.stats()["leases"] == 8
        cases = [[lb], [la, lb], [la, 10**9], [-1], [2**64 - 1], [la + lb + 1000]]
        for leases in cases:
            status, reply = a.call(Op.RELEASE, {"leases": leases})
            assert status == protocol.STATUS_ERROR and reply["code"] == "bad_request", leases
            assert live.stats()["leases"] == 8  # all-or-nothing: not even la was released
        a.ok(Op.RELEASE, {"leases": [la]})
        for _ in range(2):  # double release
            status, reply = a.call(Op.RELEASE, {"leases": [la]})
            assert status == protocol.STATUS_ERROR
        assert live.stats()["leases"] == 4
        # release before any acquire on a fresh connection
        fresh = RawClient(live.socket)
        fresh.hello(Namespace("test-model", SMALL))
        assert fresh.call(Op.RELEASE, {"leases": [1]})[0] == protocol.STATUS_ERROR
        fresh.close()
        # the same key twice in one lease, released once, leaves nothing pinned
        l2 = a.ok(Op.ACQUIRE, {"keys": [keys[0], keys[0]]})["lease"]
        a.ok(Op.RELEASE, {"leases": [l2]})
        b.ok(Op.RELEASE, {"leases": [lb]})
        assert live.stats()["leases"] == 0
    finally:
        a.close()
        b.close()
    assert settle(live, start) == start


def test_a_ticket_is_the_int_fetch_gave(live):
    """WAIT takes the int ticket FETCH gave: any other value, one equal to it (a float) included, is a bad
    request, and the ticket stays pending."""
    start = state_of(live)
    c = RawClient(live.socket)
    try:
        c.hello(Namespace("test-model", SMALL))
        ticket = c.ok(Op.FETCH, {"keys": live.keys[:2]})["ticket"]
        for bad in (float(ticket), str(ticket), None, [ticket]):
            status, reply = c.call(Op.WAIT, {"ticket": bad})
            assert status == protocol.STATUS_ERROR and reply["code"] == "bad_request", (bad, reply)
        reply = c.ok(Op.WAIT, {"ticket": ticket})
        assert type(reply["lease"]) is int and len(reply["slots"]) == 2
        c.ok(Op.RELEASE, {"leases": [reply["lease"]]})
    finally:
        c.close()
    assert settle(live, start) == start


def test_release_same_lease_twice_in_one_request(live):
    c = RawClient(live.socket)
    try:
        c.hello(Namespace("test-model", SMALL))
        lease = c.ok(Op.ACQUIRE, {"keys": live.keys[:2]})["lease"]
        status, reply = c.call(Op.RELEASE, {"leases": [lease, lease]})
        assert status == protocol.STATUS_ERROR and reply["code"] == "bad_request", reply
        assert live.stats()["leases"] == 2  # nothing released by a refused request
    finally:
        c.close()


def test_namespaces_of_closed_connections_are_forgotten(live):
    before = len(live.stats()["namespaces"])
    for i in range(300):
        c = RawClient(live.socket)
        c.hello(Namespace(f"junk-{i}", SMALL))
        c.close()
    wait_for(lambda: len(live.stats()["namespaces"]) <= before, timeout=5)
    assert len(live.stats()["namespaces"]) <= before


def test_second_hello_cannot_change_the_namespace(live):
    big = Layout(4, 4, 64, 16, "bfloat16")  # 64 KiB blocks
    start = state_of(live)
    c = RawClient(live.socket)
    try:
        c.hello(Namespace("test-model", SMALL))
        off = c.ok(Op.ALLOC, {"n": 1})["slots"][0]
        status, _ = c.hello(Namespace("other-model", big))
        if status == protocol.STATUS_OK:
            # the slot is 8 KiB; publishing it as a 64 KiB block must be refused
            status, reply = c.call(Op.COMMIT, {"keys": [os.urandom(16)], "slots": [off]})
        assert status == protocol.STATUS_ERROR
    finally:
        c.close()
    assert settle(live, start) == start


# ---- memory ---------------------------------------------------------------------------------------
def _barrage(d: Daemon) -> None:
    for frame in list(FATAL_FRAMES.values()) + list(TRUNCATED_FRAMES.values()):
        _send_and_close(d.socket, frame)
    _garbage_round(d.socket, with_hello=True)


def _garbage_body(path: str, nbytes: int) -> bytes:
    """A body of ``nbytes`` garbage (under the cap, so the daemon must read it to reject it)."""
    c = RawClient(path)
    try:
        c.sock.sendall(_hdr(length=nbytes) + b"\xc1" * nbytes)
        return c.read_to_eof()
    finally:
        c.close()


def test_daemon_memory_flat_under_bad_input(live):
    """After a warm-up round, three more rounds of every bad input leave RssAnon within 1 MB."""
    pid = live.proc.pid
    start = state_of(live)
    for _ in range(2):
        _barrage(live)
    settle(live, start)
    base = quiet_sample(pid)
    for _ in range(3):
        _barrage(live)
    assert settle(live, start) == start
    after = quiet_sample(pid)
    grown = after["anon_kb"] - base["anon_kb"]
    assert grown < 1024, f"daemon anonymous memory grew {grown} kB ({base} -> {after})"
    assert after["fds"] <= base["fds"] and after["threads"] <= base["threads"], (base, after)
    check_data(live)


def test_garbage_body_at_the_cap_costs_about_its_size(daemon_factory):
    """A body under the cap must be read before it can be rejected; it should cost about its own size."""
    d = daemon_factory(env=FAST_ENV)
    pid = d.proc.pid
    idle = quiet_sample(pid)
    size = 8 << 20
    data = _garbage_body(d.socket, size)
    assert protocol.parse_header(data[:16], MAX_FRAME)[1] == protocol.STATUS_ERROR
    after = quiet_sample(pid)
    kept = (after["anon_kb"] - idle["anon_kb"]) * 1024
    assert kept < 2 * size, f"one {size >> 20} MiB frame left {kept / 2**20:.1f} MiB behind"


def test_many_tiny_frames_pipelined(live):
    """50k pipelined PINGs on one connection: every reply arrives, memory stays flat, others unaffected."""
    n = 50_000
    pid = live.proc.pid
    start = state_of(live)
    base = quiet_sample(pid)
    c = RawClient(live.socket, timeout=60)
    frames = b"".join(protocol.pack(Op.PING, i, {}) for i in range(n))
    got = []

    def reader() -> None:
        reader_frames = protocol.FrameReader(c.sock, MAX_FRAME)
        for _ in range(n):
            got.append(reader_frames.read()[2])

    t = threading.Thread(target=reader)
    t.start()
    c.sock.sendall(frames)
    check_data(live)  # a normal client is served meanwhile
    t.join(120)
    c.close()
    assert got == list(range(n))
    assert settle(live, start) == start
    after = quiet_sample(pid)
    assert after["anon_kb"] - base["anon_kb"] < 1024, (base, after)


def test_header_struct_is_what_the_tests_assume():
    # the hand-built frames above rely on this layout: magic, version, flags, op, status, rid, length
    assert HEADER.format == "<2sBBHHII" and HEADER.size == 16
    assert struct.unpack("<I", struct.pack("<i", -1))[0] == 0xFFFFFFFF

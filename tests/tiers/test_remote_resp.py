"""The RESP2 reply reader of the remote tier (tierkv.tiers.remote.resp) over a scripted socket: replies
read back as sent however the stream is split, and any byte stream ends in a value or a clear error."""

from __future__ import annotations

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv.tiers.remote.resp import MAX_LINE, READ_CHUNK, SKIPPED, Desync, ReplyError, SocketReader


class ScriptedSocket:
    """``recv_into`` hands out ``data`` in the given chunk sizes, then reports a closed connection."""

    def __init__(self, data: bytes, chunks: list[int] | None = None) -> None:
        self.data = data
        self.pos = 0
        self.chunks = list(chunks or [])

    def recv_into(self, buf: memoryview) -> int:
        want = self.chunks.pop(0) if self.chunks else len(buf)
        n = min(len(buf), max(1, want), len(self.data) - self.pos)
        buf[:n] = self.data[self.pos:self.pos + n]
        self.pos += n
        return n


def encode(reply: object) -> bytes:
    if reply is None:
        return b"$-1\r\n"
    if isinstance(reply, ReplyError):
        return b"-" + reply.encode() + b"\r\n"
    if isinstance(reply, int):
        return b":%d\r\n" % reply
    if isinstance(reply, tuple):  # ("+", status)
        return b"+" + reply[1] + b"\r\n"
    assert isinstance(reply, bytes)
    return b"$%d\r\n%s\r\n" % (len(reply), reply)


def into_limited(limit: int):
    def into(n: int) -> memoryview | None:
        return memoryview(bytearray(n)) if n <= limit else None
    return into


line_text = st.binary(max_size=40).filter(lambda b: b"\r" not in b and b"\n" not in b)
replies = st.one_of(
    st.none(),
    st.integers(-(2 ** 63), 2 ** 63 - 1),
    st.binary(max_size=3000),
    line_text.map(lambda b: ("+", b)),
    st.text(alphabet=st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), min_size=1,
            max_size=40).map(ReplyError),
)


def expected(reply: object, limit: int) -> object:
    if isinstance(reply, tuple):
        return reply[1]
    if isinstance(reply, bytes) and len(reply) > limit:
        return SKIPPED
    return reply


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(replies, max_size=12), st.lists(st.integers(1, 5000), max_size=40), st.integers(0, 4000))
def test_replies_read_back_however_the_stream_is_split(sent, chunks, limit):
    sock = ScriptedSocket(b"".join(encode(r) for r in sent), chunks)
    rd = SocketReader(sock)
    into = into_limited(limit)
    for r in sent:
        got = rd.reply(into)
        want = expected(r, limit)
        if isinstance(got, memoryview):
            got = bytes(got)
        assert got == want if want is not SKIPPED else got is SKIPPED
    rd.finish()  # nothing left over


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=2000), st.lists(st.integers(1, 300), max_size=20), st.booleans())
def test_any_stream_gives_replies_or_a_clear_error(data, chunks, with_into):
    rd = SocketReader(ScriptedSocket(data, chunks))
    into = into_limited(1024) if with_into else None
    try:
        for _ in range(len(data) + 1):
            r = rd.reply(into)
            assert r is None or r is SKIPPED or isinstance(r, (bytes, int, memoryview, ReplyError))
        pytest.fail("more replies than bytes")
    except (Desync, redis.ConnectionError):
        pass  # a broken stream or the end of the data: the connection is dropped


@settings(max_examples=200, deadline=None)
@given(st.lists(replies, min_size=1, max_size=6), st.data())
def test_truncated_stream_ends_in_a_closed_connection(sent, data):
    stream = b"".join(encode(r) for r in sent)
    cut = data.draw(st.integers(0, len(stream) - 1))
    rd = SocketReader(ScriptedSocket(stream[:cut]))
    with pytest.raises(redis.ConnectionError):
        for _ in sent:
            rd.reply(into_limited(1 << 20))


@pytest.mark.parametrize(("stream", "error"), [
    (b"*2\r\n", "unexpected reply"),           # arrays are never asked for
    (b"$abc\r\n", "bad reply"),
    (b":12x\r\n", "bad reply"),
    (b"$3\r\nabcXY", "not followed by CRLF"),
    (b"+" + b"x" * MAX_LINE, "too long"),
    (b"$" + b"9" * 5000 + b"\r\n", "bad reply"),  # more digits than an int may have
])
def test_protocol_breaks_are_desync(stream, error):
    with pytest.raises(Desync, match=error):
        SocketReader(ScriptedSocket(stream + b"\r\n" * 4)).reply(into_limited(1 << 20))


def test_leftover_bytes_fail_finish():
    rd = SocketReader(ScriptedSocket(b"+OK\r\n:1\r\n"))
    assert rd.reply() == b"OK"
    with pytest.raises(Desync, match="unexpected bytes"):
        rd.finish()


def test_large_value_lands_in_the_callers_buffer():
    value = bytes(range(256)) * (3 * READ_CHUNK // 256 + 7)
    dst = bytearray(len(value) + 10)
    rd = SocketReader(ScriptedSocket(encode(value), [100, 70000, 5]))
    got = rd.reply(lambda n: memoryview(dst))
    assert isinstance(got, memoryview) and got.obj is dst and bytes(got) == value
    rd.finish()


def test_unasked_huge_value_is_drained_not_allocated():
    n = 10 * MAX_LINE
    rd = SocketReader(ScriptedSocket(b"$%d\r\n" % n + b"\x00" * n + b"\r\n+OK\r\n"))
    assert rd.reply() is SKIPPED  # no into: a status was expected, a huge value came
    assert rd.reply() == b"OK"
    rd.finish()

"""RESP2 replies of pipelined commands, read from a connected socket or through redis-py's parser.

:class:`SocketReader` reads replies straight from the connection's socket with ``recv_into``: a bulk
value lands in the buffer that ``into(n)`` returns with one copy from the kernel (redis-py's
pure-Python parser copies a 2 MiB value several times, hiredis twice). It knows the replies of the
commands the tier sends (bulk, status, integer, error, nil) and nothing else: anything it cannot read
raises :class:`Desync`, after which the connection must be dropped. :class:`ParserReader` offers the
same interface over redis-py's own parser.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
from redis.exceptions import RedisError, ResponseError

__all__ = ["SKIPPED", "Desync", "Into", "ParserReader", "ReplyError", "SocketReader"]

MAX_LINE = 64 << 10  # a reply line (type + length or error text) longer than this is a broken stream
READ_CHUNK = 64 << 10


class ReplyError(str):
    """An error reply of one command (``"OOM command not allowed ..."``); the stream is still in sync."""

    @property
    def code(self) -> str:
        return self.split(" ", 1)[0]


class Desync(RedisError):
    """The reply stream broke the protocol: the connection cannot be reused."""


SKIPPED = object()  # a bulk value that was read and thrown away (over the size limit)
Into = Callable[[int], "memoryview | None"]


class SocketReader:
    """RESP2 replies read from a connected redis-py connection's socket; bulk values land in the buffer
    ``into(n)`` returns with one copy from the kernel."""

    __slots__ = ("sock", "buf", "pos", "end")

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.buf = bytearray(READ_CHUNK)
        self.pos = self.end = 0

    def _fill(self) -> None:
        if self.pos == self.end:
            self.pos = self.end = 0
        elif self.end == len(self.buf):
            rest = self.end - self.pos
            self.buf[:rest] = self.buf[self.pos:self.end]
            self.pos, self.end = 0, rest
        n = self.sock.recv_into(memoryview(self.buf)[self.end:])
        if not n:
            raise redis.ConnectionError("the server closed the connection")
        self.end += n

    def _line(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n", self.pos, self.end)
            if i >= 0:
                line = bytes(self.buf[self.pos:i])
                self.pos = i + 2
                return line
            if self.end - self.pos >= MAX_LINE:
                raise Desync("reply line too long")
            self._fill()

    def reply(self, into: Into | None = None) -> Any:
        """One reply: bytes (bulk or status), int, None (nil), ReplyError, or SKIPPED."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        try:
            if kind == b"$":
                n = int(rest)
                return None if n < 0 else self._bulk(n, into)
            if kind == b"+":
                return rest
            if kind == b":":
                return int(rest)
        except ValueError:
            raise Desync(f"bad reply {line[:40]!r}") from None
        if kind == b"-":
            return ReplyError(rest.decode("utf-8", "replace"))
        if kind == b"_":
            return None
        raise Desync(f"unexpected reply {line[:40]!r}")

    def _bulk(self, n: int, into: Into | None) -> Any:
        if into is not None:
            dst = into(n)
        else:  # no value was asked for: keep a short one, drain a long one rather than allocate it
            dst = memoryview(bytearray(n)) if n <= MAX_LINE else None
        have = min(self.end - self.pos, n)
        if dst is not None:
            dst[:have] = memoryview(self.buf)[self.pos:self.pos + have]
        self.pos += have
        got = have
        while got < n:
            if dst is not None:
                k = self.sock.recv_into(dst[got:n])
                if not k:
                    raise redis.ConnectionError("the server closed the connection")
                got += k
            else:  # over the limit: drain it through the line buffer without keeping it
                self.pos = self.end = 0
                k = self.sock.recv_into(memoryview(self.buf)[:min(len(self.buf), n - got)])
                if not k:
                    raise redis.ConnectionError("the server closed the connection")
                got += k
        while self.end - self.pos < 2:
            self._fill()
        if self.buf[self.pos:self.pos + 2] != b"\r\n":
            raise Desync("bulk value not followed by CRLF")
        self.pos += 2
        return dst[:n] if dst is not None else SKIPPED

    def finish(self) -> None:
        if self.pos != self.end:
            raise Desync(f"{self.end - self.pos} unexpected bytes after the replies")


class ParserReader:
    """The same interface over redis-py's own parser (``fast_reads=False``, or no raw socket)."""

    __slots__ = ("conn",)

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def reply(self, into: Into | None = None) -> Any:
        try:
            value = self.conn.read_response(disable_decoding=True)
        except ResponseError as exc:
            return ReplyError(str(exc))
        if isinstance(value, (bytes, bytearray)) and into is not None:
            dst = into(len(value))
            if dst is None:
                return SKIPPED
            dst[:len(value)] = value
            return dst[:len(value)]
        return value

    def finish(self) -> None:
        pass

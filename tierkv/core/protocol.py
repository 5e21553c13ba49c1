"""Wire protocol: versioned, length-prefixed frames over a Unix socket; msgpack bodies, never pickle.

Frame = 16-byte header + body::

    magic b"TK" | version u8 | flags u8 | opcode u16 | status u16 | request id u32 | body length u32

The body length is checked against the cap *before* anything is allocated. Requests carry status 0;
replies echo the opcode and request id with status 0 (body = result map) or 1 (body = ``{code, message}``).
Bulk data never travels here: blocks live in shared memory and frames carry slot offsets.
"""

from __future__ import annotations

import enum
import mmap
import socket
import struct
import threading
from typing import Any

import msgpack

from tierkv.core.errors import ProtocolError

MAGIC = b"TK"
VERSION = 1
HEADER = struct.Struct("<2sBBHHII")
HEADER_BYTES = HEADER.size
DEFAULT_MAX_FRAME = 16 << 20
STATUS_OK = 0
STATUS_ERROR = 1


class Op(enum.IntEnum):
    """Opcodes. Numbers are part of the wire format: never reuse one."""

    PING = 1
    HELLO = 2
    ALLOC = 3
    COMMIT = 4
    ABORT = 5
    LOOKUP = 6
    ACQUIRE = 7
    RELEASE = 8
    STATS = 9
    TOUCH = 10
    PREFETCH = 11
    TUNE = 12
    CONFIG = 13
    HEALTH = 14
    PIN = 15
    DELETE = 16
    VERIFY = 17
    UNPIN = 18
    WINDOW = 19
    FETCH = 20
    WAIT = 21
    PLAN = 22
    RECOMPUTE = 23
    SYNC = 24
    REQUEST_FINISHED = 25
    OFFER = 26
    CLOCK = 27


_local = threading.local()


def pack(op: int, rid: int, body: Any, status: int = STATUS_OK) -> bytes:
    """Encode one frame (header and body in one buffer: one ``sendall``, one syscall for small frames)."""
    packer = getattr(_local, "packer", None)
    if packer is None:  # one Packer per thread: ``packb`` would set up a new one (and its buffer) per call
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    try:
        payload = packer.pack(body)
    except BaseException:
        _local.packer = None  # a failed pack may leave a partial body in its buffer
        raise
    if len(payload) > 1 << 16:
        _local.packer = None  # its buffer grew to this size: do not keep it per thread
    return HEADER.pack(MAGIC, VERSION, 0, op, status, rid & 0xFFFFFFFF, len(payload)) + payload


def parse_header(buf: bytes, max_frame: int) -> tuple[int, int, int, int]:
    """Validate a header; return (opcode, status, request id, body length). Raises ProtocolError."""
    magic, version, _flags, op, status, rid, length = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError("bad frame magic (not a tierkv client?)")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this side speaks {VERSION})")
    if length > max_frame:
        raise ProtocolError(f"frame of {length} bytes exceeds the {max_frame}-byte cap")
    return op, status, rid, length


def unpack_body(payload: bytes | bytearray | memoryview, max_frame: int) -> Any:
    """Decode a msgpack body with limits (no ext types, string keys only)."""
    try:
        # The frame length was capped before reading; msgpack bounds every container by it as well.
        return msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True, ext_hook=_no_ext)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable frame body: {type(exc).__name__}") from None


def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed")


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Read exactly ``n`` bytes or raise ConnectionError on EOF."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return buf


def recv_frame(sock: socket.socket, max_frame: int = DEFAULT_MAX_FRAME) -> tuple[int, int, int, Any]:
    """Read one frame; return (opcode, status, request id, body)."""
    op, status, rid, length = parse_header(bytes(recv_exact(sock, HEADER_BYTES)), max_frame)
    body = unpack_body(recv_exact(sock, length), max_frame) if length else None
    return op, status, rid, body


class FrameReader:
    """Buffered frame reader: one ``recv_into`` a fixed buffer usually brings a whole small frame (header
    and body); nothing is allocated per frame but the decoded body."""

    def __init__(self, sock: socket.socket, max_frame: int = DEFAULT_MAX_FRAME, bufsize: int = 1 << 16) -> None:
        self.sock = sock
        self.max_frame = max_frame
        self.bufsize = bufsize
        self._buf = bytearray(bufsize)
        self._view = memoryview(self._buf)
        self._start = 0  # unread bytes are _buf[_start:_end]
        self._end = 0

    def _fill(self, n: int) -> None:
        """Have at least ``n`` (<= bufsize) unread bytes in the buffer."""
        if self._start + n > self.bufsize:  # not enough room after the unread bytes: move them to the front
            have = self._end - self._start
            self._buf[:have] = self._view[self._start:self._end]
            self._start, self._end = 0, have
        while self._end - self._start < n:
            k = self.sock.recv_into(self._view[self._end:])
            if k == 0:
                raise ConnectionError("peer closed the connection")
            self._end += k

    def read(self) -> tuple[int, int, int, Any]:
        """Read one frame; return (opcode, status, request id, body)."""
        if self._end - self._start < HEADER_BYTES:
            self._fill(HEADER_BYTES)
        magic, version, _flags, op, status, rid, length = HEADER.unpack_from(self._buf, self._start)
        if magic != MAGIC or version != VERSION or length > self.max_frame:
            parse_header(bytes(self._view[self._start:self._start + HEADER_BYTES]), self.max_frame)  # raises
        start = self._start + HEADER_BYTES
        if length > self.bufsize - HEADER_BYTES:
            # A large body goes into an anonymous mapping of its size: pages are touched only as bytes
            # arrive (a truncated frame costs what was sent, not what it claimed) and go back to the OS
            # afterwards (malloc would keep them: the daemon runs with a 256 MiB trim threshold).
            with mmap.mmap(-1, length) as area, memoryview(area) as view:
                have = self._end - start  # < length: the buffer cannot hold this body, so all it holds is body
                view[:have] = self._view[start:self._end]
                self._start = self._end = 0
                while have < length:
                    k = self.sock.recv_into(view[have:], length - have)
                    if k == 0:
                        raise ConnectionError("peer closed the connection")
                    have += k
                return op, status, rid, unpack_body(view, self.max_frame)
        end = start + length  # safe: length was checked against the cap above
        if end > self._end:
            self._fill(HEADER_BYTES + length)
            start = self._start + HEADER_BYTES
            end = start + length
        self._start = end
        if end == self._end:
            self._start = self._end = 0
        if not length:
            return op, status, rid, None
        part = self._view[start:end]
        try:
            return op, status, rid, unpack_body(part, self.max_frame)
        finally:
            part.release()


def recv_frame_with_fds(sock: socket.socket, max_frame: int = DEFAULT_MAX_FRAME,
                        maxfds: int = 4) -> tuple[int, int, int, Any, list[int]]:
    """Like :func:`recv_frame` but also collects file descriptors passed with SCM_RIGHTS."""
    fds: list[int] = []
    head = bytearray()
    while len(head) < HEADER_BYTES:
        data, got_fds, _flags, _addr = socket.recv_fds(sock, HEADER_BYTES - len(head), maxfds)
        fds.extend(got_fds)
        if not data:
            for fd in fds:
                _close_quietly(fd)
            raise ConnectionError("peer closed the connection")
        head += data
    op, status, rid, length = parse_header(bytes(head), max_frame)
    body = unpack_body(recv_exact(sock, length), max_frame) if length else None
    return op, status, rid, body, fds


def _close_quietly(fd: int) -> None:
    import os

    try:
        os.close(fd)
    except OSError:
        pass

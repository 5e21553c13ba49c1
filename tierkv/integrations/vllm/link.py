"""The connector's connection to the daemon: made lazily, dropped on any failure, made again later.

vLLM must go on serving while the daemon is absent, restarting or gone: every call through a
:class:`Link` that cannot reach the daemon answers "no client" (the caller recomputes), and one
log line says the daemon went away and one that it came back, never one per request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tierkv.client.client import Client
from tierkv.core.errors import ConnectionFailed, TierKVError
from tierkv.core.layout import Layout

log = logging.getLogger("vllm.tierkv")

RETRY_FIRST_S = 0.25  # a refused Unix-socket connect costs microseconds: retry soon
RETRY_MAX_S = 1.0  # a restarted daemon is found within a second, by both sides

T = TypeVar("T")


class Link:
    """A :class:`~tierkv.client.client.Client` for one namespace, reconnected with backoff.

    Args:
        socket: the daemon's socket path (None: the client's default).
        model: the namespace's model id.
        layout: the KV geometry.
        tp_rank: this worker's tensor-parallel rank.
        tp_size: the tensor-parallel world size.
        identity: the model's identity (the namespace's; see :mod:`~tierkv.integrations.vllm.inputs`).
        clock: time source (seconds), for the backoff.
        announce: log the daemon going and coming back as warnings (one side of the connector does,
            so an outage costs one line); otherwise at debug level.
    """

    def __init__(self, socket: str | None, *, model: str, layout: Layout, tp_rank: int = 0, tp_size: int = 1,
                 identity: str = "", clock: Callable[[], float] = time.monotonic, announce: bool = True) -> None:
        self.socket = socket
        self._args: dict[str, Any] = dict(model=model, layout=layout, tp_rank=tp_rank, tp_size=tp_size,
                                          identity=identity)
        self._clock = clock
        self._client: Client | None = None
        self._next_try = 0.0
        self._delay = RETRY_FIRST_S
        self._was_up: bool | None = None
        self._lock = threading.Lock()
        self.failures = 0
        self._level = logging.WARNING if announce else logging.DEBUG

    def get(self) -> Client | None:
        """The connected client, or None while the daemon cannot be reached (tried again after a pause)."""
        c = self._client
        if c is not None:
            return c
        with self._lock:
            if self._client is None and self._clock() >= self._next_try:
                self._connect()
            return self._client

    def _connect(self) -> None:
        try:
            self._client = Client.connect(self.socket, timeout=2.0, **self._args)
        except TierKVError as exc:
            self._next_try = self._clock() + self._delay
            self._delay = min(self._delay * 2, RETRY_MAX_S)
            if self._was_up is not False:
                log.log(self._level, "tierkv: daemon not reachable (%s); vLLM recomputes until it is back", exc)
            self._was_up = False
            return
        self._delay = RETRY_FIRST_S
        if self._was_up is False:
            log.log(self._level, "tierkv: daemon reachable again at %s", self._client.socket_path)
        else:
            log.info("tierkv: connected to %s", self._client.socket_path)
        self._was_up = True

    def call(self, fn: Callable[[Client], T]) -> T | None:
        """``fn(client)``, or None when the daemon cannot be reached.

        A connection found broken is made again at once and ``fn`` tried once more (the daemon may have
        restarted since the last call); other errors of tierkv propagate.
        """
        for attempt in (0, 1):
            client = self.get()
            if client is None:
                return None
            try:
                return fn(client)
            except ConnectionFailed as exc:
                self.drop(exc, retry_now=attempt == 0)
        return None

    def drop(self, exc: BaseException, *, retry_now: bool = False) -> None:
        """Forget the client after a failed call; the next :meth:`get` reconnects (after a pause unless
        ``retry_now``)."""
        self.failures += 1
        with self._lock:
            c, self._client = self._client, None
            self._next_try = self._clock() + (0.0 if retry_now else self._delay)
            if self._was_up:
                log.log(self._level, "tierkv: lost the daemon (%s); vLLM recomputes until it is back", exc)
            self._was_up = False
        if c is not None:
            try:
                c.close()
            except Exception:  # noqa: BLE001 - the connection is already broken
                pass

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            c, self._client = self._client, None
        if c is not None:
            c.close()

"""Copy queues between the host pool and the GPU tier: CUDA streams where a GPU exists, threads in
their place elsewhere. Only the transfer engine uses them.

A queue runs batches of copies in order. Each copy may first wait for its source to be ready (a block
still coming from disk); a copy whose source never became ready is reported failed, never done. On CUDA
a batch's copies are issued non-blocking on the queue's stream (loads on a high-priority stream, so they
overtake queued stores on the device too), an event is recorded after them, and a second thread waits
for the event before reporting: the issuing thread goes on to the next batch meanwhile.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("tierkv.movers.streams")


@dataclass(slots=True)
class Copy:
    """One slot-to-slot copy; ``ready`` (if set) blocks until the source holds the block, or says it never will."""

    src: Any                                  # torch tensor (flat uint8)
    dst: Any                                  # torch tensor (flat uint8), same size
    ready: Callable[[], bool] | None = None
    ok: bool = False


Batch = tuple[list[Copy], Callable[[list[Copy]], None]]


class ThreadQueue:
    """The CPU stand-in: one thread copies batch after batch (no GIL held during large copies)."""

    kind = "thread"

    def __init__(self, name: str, gate: Callable[[int], Any] | None = None) -> None:
        self._q: queue.Queue[Batch | None] = queue.Queue()
        self._gate = gate
        self._t = threading.Thread(target=self._run, name=f"tierkv-{name}", daemon=True)
        self._t.start()

    def submit(self, copies: list[Copy], on_done: Callable[[list[Copy]], None]) -> None:
        """Queue a batch; ``on_done(copies)`` runs on the queue's thread when every copy finished."""
        self._q.put((copies, on_done))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            copies, on_done = item
            for src, dst, members in _runs(copies):
                try:
                    _admit(self._gate, members)
                    with _gated(self._gate, 0):
                        _cpu_copy(dst, src)
                    for c in members:
                        c.ok = True
                except Exception:
                    log.exception("copy failed")
            _report(on_done, copies)

    def close(self) -> None:
        """Finish queued batches, then stop."""
        self._q.put(None)
        self._t.join(30)


class CudaQueue:
    """Copies on a dedicated CUDA stream; completion by events, waited on a second thread."""

    kind = "cuda"

    def __init__(self, name: str, device: int, priority: int = 0,
                 gate: Callable[[int], Any] | None = None) -> None:
        import torch

        self._torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device=device, priority=priority)
        self._gate = gate
        self._q: queue.Queue[Batch | None] = queue.Queue()
        self._pending: queue.Queue[tuple[Any, list[Copy], Callable] | None] = queue.Queue()
        self._issuer = threading.Thread(target=self._issue, name=f"tierkv-{name}", daemon=True)
        self._waiter = threading.Thread(target=self._complete, name=f"tierkv-{name}-events", daemon=True)
        self._issuer.start()
        self._waiter.start()

    def submit(self, copies: list[Copy], on_done: Callable[[list[Copy]], None]) -> None:
        """Queue a batch; ``on_done(copies)`` runs once the stream finished it."""
        self._q.put((copies, on_done))

    def _issue(self) -> None:
        torch = self._torch
        torch.cuda.set_device(self.device)
        while True:
            item = self._q.get()
            if item is None:
                self._pending.put(None)
                return
            copies, on_done = item
            with torch.cuda.stream(self.stream):
                for src, dst, members in _runs(copies):
                    try:
                        _admit(self._gate, members)
                        with _gated(self._gate, 0):
                            dst.copy_(src, non_blocking=True)
                        for c in members:
                            c.ok = True
                    except Exception:
                        log.exception("copy failed")
                event = torch.cuda.Event()
                event.record(self.stream)
            self._pending.put((event, copies, on_done))

    def _complete(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            event, copies, on_done = item
            try:
                event.synchronize()
            except Exception:
                log.exception("CUDA copy failed")
                for c in copies:
                    c.ok = False
            _report(on_done, copies)

    def close(self) -> None:
        """Finish queued batches, then stop."""
        self._q.put(None)
        self._issuer.join(30)
        self._waiter.join(30)


_ntcopy: Callable[[Any, Any], None] | None
try:  # streaming-store copy (tierkv/_native/ntcopy.c); the GIL is released during the copy
    from tierkv._native._ntcopy import copy as _ntcopy
except ImportError:  # pragma: no cover - the extension is optional
    _ntcopy = None


def _cpu_copy(dst: Any, src: Any) -> None:
    if _ntcopy is not None:
        _ntcopy(dst.numpy(), src.numpy())
    else:
        dst.copy_(src)


def _runs(copies: list[Copy]) -> list[tuple[Any, Any, list[Copy]]]:
    """Ready copies merged into runs where both sides are adjacent in memory (slots allocated in a row
    usually are): one large copy instead of many 2 MiB ones (each CUDA launch costs ~10 us)."""
    import torch

    out: list[tuple[Any, Any, list[Copy]]] = []
    run: list[Copy] = []

    def close() -> None:
        if not run:
            return
        n = sum(c.src.numel() for c in run)
        if len(run) == 1:
            out.append((run[0].src, run[0].dst, list(run)))
        else:
            out.append((torch.as_strided(run[0].src, (n,), (1,)), torch.as_strided(run[0].dst, (n,), (1,)), list(run)))
        run.clear()

    for c in copies:
        if c.ready is not None and not c.ready():
            close()
            continue  # its source never arrived: reported failed
        if run:
            last = run[-1]
            if (c.src.data_ptr() == last.src.data_ptr() + last.src.numel()
                    and c.dst.data_ptr() == last.dst.data_ptr() + last.dst.numel()
                    and c.src.untyped_storage().data_ptr() == last.src.untyped_storage().data_ptr()
                    and c.dst.untyped_storage().data_ptr() == last.dst.untyped_storage().data_ptr()):
                run.append(c)
                continue
            close()
        run.append(c)
    close()
    return out


class _NullGate:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _admit(gate: Callable[[int], Any] | None, members: list[Copy]) -> None:
    """Take a merged run's budget block by block: one request larger than a bucket's burst would pass at
    once and leave the debt to whoever comes next."""
    if gate is not None:
        for c in members:
            with gate(c.src.numel()):
                pass


def _gated(gate: Callable[[int], Any] | None, nbytes: int) -> Any:
    return gate(nbytes) if gate is not None else _NullGate()


def _report(on_done: Callable[[list[Copy]], None], copies: list[Copy]) -> None:
    try:
        on_done(copies)
    except Exception:
        log.exception("copy completion")


def make_queue(kind: str, name: str, device: int = 0, high_priority: bool = False,
               gate: Callable[[int], Any] | None = None) -> ThreadQueue | CudaQueue:
    """A CUDA stream queue (``kind == "cuda"``) or its thread stand-in."""
    if kind == "cuda":
        import torch

        # (least, greatest) priority; the greatest is the most negative number. torch's stub declares
        # this static method as an instance method.
        lo, hi = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
        return CudaQueue(name, device, priority=hi if high_priority else lo, gate=gate)
    return ThreadQueue(name, gate=gate)

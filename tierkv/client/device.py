"""A client's mapping of the daemon's GPU pool: device views of slots by offset.

On CUDA the pool arrives as an IPC handle; the CPU stand-in arrives as a second memfd after the host
pool's. The client sees the same views either way.
"""

from __future__ import annotations

import mmap
import os

import torch


class MappedDevicePool:
    """The daemon's GPU pool (or its CPU stand-in) mapped into this process."""

    def __init__(self, desc: dict, fd: int | None) -> None:
        self.kind = str(desc.get("kind"))
        self.index = int(desc.get("device", 0))
        self.nbytes = int(desc.get("bytes", 0))
        self._ptr = 0
        self._mm: mmap.mmap | None = None
        if self.kind == "cuda":
            from tierkv.core import cuda

            if fd is not None:
                os.close(fd)
            self._ptr = cuda.ipc_open(bytes(desc["handle"]), self.index)
            self.tensor = cuda.device_tensor(self._ptr, self.nbytes, self.index)
        elif self.kind == "standin":
            if fd is None:
                raise ValueError("the daemon did not pass the GPU stand-in pool")
            try:
                self._mm = mmap.mmap(fd, self.nbytes, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                     mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        else:
            raise ValueError(f"unknown GPU pool kind {self.kind!r}")

    @property
    def device(self) -> str:
        """The torch device of the views."""
        return f"cuda:{self.index}" if self.kind == "cuda" else "cpu"

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A flat uint8 view of a slot."""
        return self.tensor[offset:offset + nbytes]

    def synchronize(self) -> None:
        """Wait for the current CUDA stream (a no-op for the stand-in): copies are done before the
        daemon reads the slots, or before a lease on them ends."""
        if self.kind == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        """Unmap the pool (views taken earlier must not be used afterwards)."""
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._ptr:
            from tierkv.core import cuda

            torch.cuda.synchronize(self.index)
            cuda.ipc_close(self._ptr, self.index)
            self._ptr = 0
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a view is still alive somewhere; the mapping goes with the last reference
            self._mm = None

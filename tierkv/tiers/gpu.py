"""GPU tier: one pool of device memory split into slots, shared with clients.

On a CUDA machine the pool is one ``cudaMalloc`` of the configured size, exported to clients as a CUDA
IPC handle; clients map it and get device views of slots, so an engine stores its KV with a
device-to-device copy and goes on. Without CUDA (CI, laptops) the same tier runs as a stand-in: the
"device" memory is a second sealed memfd passed like the host pool, and the transfer engine moves bytes
with threads in place of streams. The block table and the protocol cannot tell the two apart.
"""

from __future__ import annotations

import os
from typing import Any

from tierkv.tiers.host import SlabAllocator, shared_mapping


def resolve_device(device: str) -> tuple[str, int]:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` -> (kind, index); kind is ``cuda`` or ``standin``.

    Raises:
        ValueError: the name is unknown, or CUDA was asked for and is not there.
    """
    from tierkv.core import cuda

    name = device.strip().lower()
    if name == "cpu":
        return "standin", 0
    if name == "auto":
        return ("cuda", 0) if cuda.available() else ("standin", 0)
    if name == "cuda" or name.startswith("cuda:"):
        index = 0
        if ":" in name:
            try:
                index = int(name.split(":", 1)[1])
            except ValueError:
                raise ValueError(f"gpu.device: bad device {device!r}") from None
        if not cuda.available():
            raise ValueError(f"gpu.device={device!r} but torch sees no CUDA device (use 'auto' or 'cpu')")
        import torch

        if not 0 <= index < torch.cuda.device_count():
            raise ValueError(f"gpu.device={device!r}: only {torch.cuda.device_count()} CUDA devices")
        return "cuda", index
    raise ValueError(f"gpu.device: expected auto, cpu, cuda or cuda:N, got {device!r}")


class DevicePool(SlabAllocator):
    """Device memory (or its stand-in) and its slab allocator; the block table serialises calls."""

    def __init__(self, capacity: int, slab_bytes: int, device: str = "auto") -> None:
        import torch

        super().__init__(capacity, slab_bytes)
        self.kind, self.index = resolve_device(device)
        self.fd = -1
        self.handle = b""
        self._ptr = 0
        self._mm = None
        if self.kind == "cuda":
            from tierkv.core import cuda

            self._ptr = cuda.malloc(self.capacity, self.index)
            try:
                self.handle = cuda.ipc_handle(self._ptr, self.index)
                self.tensor = cuda.device_tensor(self._ptr, self.capacity, self.index)
            except Exception:
                cuda.free(self._ptr, self.index)
                raise
        else:
            self.fd, self._mm = shared_mapping("tierkv-gpu-standin", self.capacity, prefault=True)
            self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)

    @property
    def device(self) -> str:
        """The torch device of the pool's views (``cpu`` for the stand-in)."""
        return f"cuda:{self.index}" if self.kind == "cuda" else "cpu"

    def view(self, offset: int, nbytes: int) -> Any:
        """A flat uint8 torch view of ``nbytes`` at ``offset`` (on the device; no copy)."""
        return self.tensor[offset:offset + nbytes]

    def export(self) -> tuple[dict, list[int]]:
        """What a client needs to map the pool: a description and the fds to pass (stand-in only)."""
        desc = {"kind": self.kind, "bytes": self.capacity, "device": self.index, "handle": self.handle}
        return desc, ([self.fd] if self.fd >= 0 else [])

    def close(self) -> None:
        """Free the device memory (clients' IPC mappings keep it alive until they close them)."""
        import torch

        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self.kind == "cuda" and self._ptr:
            from tierkv.core import cuda

            torch.cuda.synchronize(self.index)
            cuda.free(self._ptr, self.index)
            self._ptr = 0
        _unmap(self._mm)
        self._mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _unmap(mm: Any) -> None:
    """Close a stand-in pool's mapping (None: there is none)."""
    if mm is not None:
        try:
            mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the last reference

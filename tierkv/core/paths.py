"""Where the daemon's socket lives by default: shared by the client and the daemon, free of their
dependencies (an engine process imports this without the daemon's modules)."""

from __future__ import annotations

import os
from pathlib import Path


def default_runtime_dir() -> Path:
    """Where the daemon's socket lives by default: ``$XDG_RUNTIME_DIR/tierkv`` or ``/tmp/tierkv-<uid>``."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    return Path(base) / "tierkv" if base else Path(f"/tmp/tierkv-{os.getuid()}")


def default_socket() -> str:
    """The socket path clients and the daemon use when none is given (``TIERKV_SOCKET`` overrides)."""
    return os.environ.get("TIERKV_SOCKET") or str(default_runtime_dir() / "tierkv.sock")

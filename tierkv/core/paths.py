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


def replace_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (a synced temporary file, mode 600, renamed over it); a
    failure leaves ``path`` as it was and no temporary file behind.

    Raises:
        OSError: the write or the rename failed.
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise

"""Types of the streaming-store copy extension (native/ntcopy.c)."""

from collections.abc import Sequence
from typing import Any

from numpy.typing import NDArray
from typing_extensions import Buffer

# numpy arrays export the buffer protocol; numpy's stubs say so only for Python 3.12+.
_Buf = Buffer | NDArray[Any]

def copy(dst: _Buf, src: _Buf, /) -> None:
    """Copy equal-sized contiguous buffers with streaming stores (``dst`` writable)."""

def merge_planes(dst: _Buf, planes: Sequence[_Buf], /) -> None:
    """Words from byte planes, most significant first (``dst`` writable)."""

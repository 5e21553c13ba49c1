"""Progress bars (rich) for long CLI work; silent when stderr is not a terminal, so pipes and logs stay clean."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import TextIO

Advance = Callable[..., None]


def _noop(n: int = 1, description: str | None = None, total: int | None = None) -> None:
    return None


@contextlib.contextmanager
def bar(total: int | None, description: str, out: TextIO | None = None) -> Iterator[Advance]:
    """A bar on ``out`` (stderr) while inside; yields ``advance(n=1, description=None, total=None)``.

    ``total=None`` shows a pulsing bar with the elapsed time until an ``advance`` call sets a total.
    """
    out = sys.stderr if out is None else out
    if not out.isatty():
        yield _noop
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn()]
    columns += [MofNCompleteColumn(), TimeRemainingColumn()]
    columns.append(TimeElapsedColumn())
    with Progress(*columns, console=Console(file=out), transient=True) as p:
        task = p.add_task(description, total=total)

        def advance(n: int = 1, description: str | None = None, total: int | None = None) -> None:
            p.update(task, advance=n, description=description, total=total)  # None changes nothing

        yield advance

"""Console output of the commands: their width, a per-phase time profile and human-readable sizes.

Output to a terminal is as wide as the terminal. Output to anything else (a pipe, a file, a CI log) is not cut
or wrapped at 80 columns, rich's default there: each line is as long as its content (up to
:data:`UNLIMITED_WIDTH`), so ``gradtrace topk ... | grep`` sees whole texts. ``gradtrace --width N COMMAND``
(:func:`set_width`) sets the width of both; the ``COLUMNS`` environment variable, when set, is honoured as rich
does.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.table import Table

from ..common.units import human_bytes

__all__ = ["UNLIMITED_WIDTH", "Phases", "console", "human_bytes", "set_width"]

UNLIMITED_WIDTH = 100_000
"""Columns of output that is not a terminal: in effect unlimited (tables are as wide as their content)."""

_width: int | None = None  # gradtrace --width N


def set_width(width: int | None) -> None:
    """The width of every console made from now on (None: the terminal's, unlimited for a pipe or a file)."""
    global _width
    _width = width


def console(stderr: bool = False) -> Console:
    """A rich console on the current stdout/stderr (made per call, so redirected streams are honoured), as wide as
    ``--width``, else the terminal, else unlimited (not a terminal, no ``COLUMNS``)."""
    width = _width
    if width is None and not os.environ.get("COLUMNS") and not _is_terminal(sys.stderr if stderr else sys.stdout):
        width = UNLIMITED_WIDTH
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=width)


def _is_terminal(stream: object) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (OSError, ValueError):  # a closed stream
        return False


class Phases:
    """Wall time of each phase of a command, printed as a table at the end of the run."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.notes: dict[str, str] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def note(self, name: str, text: str) -> None:
        self.notes[name] = text

    def table(self) -> Table:
        total = sum(self.seconds.values()) or 1e-9
        table = Table(title="Where the time went", title_justify="left", box=None, pad_edge=False)
        table.add_column("phase")
        table.add_column("seconds", justify="right")
        table.add_column("share", justify="right")
        table.add_column("")
        for name, seconds in self.seconds.items():
            table.add_row(name, f"{seconds:.2f}", f"{100 * seconds / total:.0f}%", self.notes.get(name, ""))
        table.add_row("total", f"{total:.2f}", "", "")
        return table

"""Console output of the commands: a per-phase time profile and human-readable sizes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.table import Table

from ..common.units import human_bytes

__all__ = ["Phases", "console", "human_bytes"]


def console(stderr: bool = False) -> Console:
    """A rich console on the current stdout/stderr (made per call, so redirected streams are honoured)."""
    return Console(stderr=stderr, highlight=False, soft_wrap=False)


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

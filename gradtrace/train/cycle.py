"""Batches drawn one at a time, starting over when they run out (validation / meta batches of a callback)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["Cycle"]


class Cycle:
    """``next()`` yields the batches of ``batches`` in order, again from the start when they run out; a one-shot
    iterator (or an empty iterable) that runs out is a clear error naming ``what``."""

    def __init__(self, batches: Iterable[Any], what: str) -> None:
        self.batches = batches
        self.what = what
        self._iter: Iterator[Any] | None = None

    def next(self) -> Any:
        if self._iter is None:
            self._iter = iter(self.batches)
        batch = next(self._iter, None)
        if batch is None:  # exhausted: start over (a one-shot iterator cannot)
            self._iter = iter(self.batches)
            batch = next(self._iter, None)
            if batch is None:
                raise ValueError(f"the {self.what} ran out and cannot be re-iterated: pass a list or a DataLoader")
        return batch

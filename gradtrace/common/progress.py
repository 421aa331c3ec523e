"""Progress of long loops: a tqdm bar on a terminal or in a notebook, plain lines anywhere else.

A tqdm bar redraws itself with carriage returns several times a second; in a log file, a CI job or a pipe that is
thousands of frames on one line. When stderr is not a terminal (and not a notebook), :func:`progress_bar` makes a
:class:`LineProgress` instead, which writes one plain line each time another tenth of the work is done or
:data:`LINE_SECONDS` have passed since its last line, and one when it closes::

    collect: 2/5 batch (40%), 0:03 elapsed, ~0:04 left, 0.7 batch/s; 10 examples, 3.3/s

Both take the tqdm calls gradtrace's loops make: iteration, ``update``, ``set_postfix_str``, ``close``, and
``format_dict["elapsed"]``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

__all__ = ["LINE_SECONDS", "LINE_STEPS", "LineProgress", "progress_bar"]

LINE_SECONDS = 30.0
"""Longest time between two plain progress lines (when a tenth of the work takes longer, or without a total)."""
LINE_STEPS = 10
"""A plain line each time another ``1 / LINE_STEPS`` of the total is done."""


def progress_bar(iterable: Iterable[Any] | None = None, *, total: int | None = None, desc: str, unit: str,
                 initial: int = 0, stream: TextIO | None = None) -> Any:
    """A tqdm bar over ``iterable`` (or advanced by ``update``) when ``stream`` (default: stderr) is a terminal or
    a notebook runs this, else a :class:`LineProgress` writing plain lines to it."""
    target = sys.stderr if stream is None else stream
    if _is_terminal(target) or _in_notebook():
        from tqdm.auto import tqdm

        extra = {} if stream is None else {"file": stream}
        return tqdm(iterable, total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, **extra)
    return LineProgress(iterable, total=total, desc=desc, unit=unit, initial=initial, stream=target)


class LineProgress:
    """tqdm's interface, printed as a plain line every tenth of ``total`` or every :data:`LINE_SECONDS`."""

    def __init__(self, iterable: Iterable[Any] | None = None, *, total: int | None = None, desc: str = "",
                 unit: str = "it", initial: int = 0, stream: TextIO | None = None) -> None:
        if total is None and iterable is not None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.n = self._start_n = self._shown_n = initial
        self.stream = stream
        self.postfix = ""
        self.closed = False
        self._start = self._shown = time.monotonic()
        self._next_step = self._step() + 1

    @property
    def format_dict(self) -> dict[str, Any]:
        return {"n": self.n, "total": self.total, "elapsed": time.monotonic() - self._start, "unit": self.unit}

    def __iter__(self) -> Iterator[Any]:
        if self.iterable is None:
            raise TypeError("this progress has no iterable: advance it with update()")
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError("this progress has no total")
        return self.total

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        step = self._step()
        if step >= self._next_step or now - self._shown >= LINE_SECONDS:
            self._next_step = step + 1
            self._write(now)

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = str(s)

    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True, **kwargs: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in {**(ordered_dict or {}), **kwargs}.items())

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""

    def refresh(self) -> None:
        """Nothing to redraw: lines are written as the work advances."""

    def close(self) -> None:
        """The last line (unless the last one written already showed this count)."""
        if self.closed:
            return
        self.closed = True
        if self.n != self._shown_n:
            self._write(time.monotonic(), done=True)

    def _step(self) -> int:
        return self.n * LINE_STEPS // self.total if self.total else 0

    def _write(self, now: float, done: bool = False) -> None:
        elapsed = now - self._start
        rate = (self.n - self._start_n) / elapsed if elapsed > 0 else 0.0
        count = f"{self.n:,}/{self.total:,} {self.unit} ({100 * self.n / self.total:.0f}%)" if self.total else \
            f"{self.n:,} {self.unit}"
        parts = [count, f"{'done in ' if done else ''}{_clock(elapsed)}{'' if done else ' elapsed'}"]
        if self.total and rate > 0 and not done and self.n < self.total:
            parts.append(f"~{_clock((self.total - self.n) / rate)} left")
        parts.append(f"{rate:,.1f} {self.unit}/s" if rate >= 1 else f"{rate:.2g} {self.unit}/s")
        line = f"{self.desc}: " if self.desc else ""
        line += ", ".join(parts) + (f"; {self.postfix}" if self.postfix else "")
        stream = self.stream if self.stream is not None else sys.stderr
        try:
            stream.write(line + "\n")
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: progress is not worth an error
            pass
        self._shown, self._shown_n = now, self.n


def _clock(seconds: float) -> str:
    """``0:07``, ``12:03``, ``1:02:03``."""
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (OSError, ValueError):
        return False


def _in_notebook() -> bool:
    """Whether a Jupyter kernel runs this (tqdm.auto then draws a widget, which is no log flood)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except Exception:  # an IPython too old or half-imported: not a notebook we can tell
        return False
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})

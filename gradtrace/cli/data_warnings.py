"""Warnings about data files that changed since they were collected, printed as one line each."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["data_warnings_shown"]


@contextmanager
def data_warnings_shown() -> Iterator[None]:
    """Each :class:`gradtrace.data.files.DataChangedWarning` raised inside (a data file that changed since it was
    collected or scored) printed as one ``Warning: ...`` line on stderr; other warnings pass on as they are."""
    from ..data.files import DataChangedWarning
    from .console import console

    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:  # type: ignore[assignment]
            warnings.simplefilter("always", DataChangedWarning)
            yield
    finally:  # also when the command then fails: the warning may be why
        for warning in caught:
            if issubclass(warning.category, DataChangedWarning):
                console(stderr=True).print(f"Warning: {warning.message}", style="yellow", markup=False,
                                           soft_wrap=True)
            else:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)

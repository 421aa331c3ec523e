"""Bad input ends a command with one clear line on stderr and exit code 2, never a traceback.

Commands raise :class:`CliError` for what they check themselves (missing files, wrong options); the
library's own input errors (a store that does not match, an unknown method, a corrupted file) are
reported the same way. Anything else is a bug and keeps its traceback. Set ``GRADTRACE_DEBUG=1`` to see
the traceback of a reported error too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import typer

from ..common.errors import BAD_INPUT_EXIT
from ..common.errors import UsageError as CliError

__all__ = ["BAD_INPUT_EXIT", "CliError", "fail", "reported_errors"]



def fail(message: str, exit_code: int = BAD_INPUT_EXIT) -> typer.Exit:
    """Print ``Error: message`` on one line of stderr; returns the :class:`typer.Exit` to raise."""
    typer.secho(f"Error: {' '.join(str(message).split())}", err=True, fg="red")
    return typer.Exit(exit_code)


def _input_errors() -> tuple[type[BaseException], ...]:
    from ..methods import MissingStage
    from ..store.layout import StoreError
    from ..store.locking import LockedError
    from ..store.spec import SpecMismatch

    return (StoreError, LockedError, SpecMismatch, MissingStage, ValueError, KeyError, FileNotFoundError,
            NotADirectoryError, IsADirectoryError, PermissionError)


@contextmanager
def reported_errors() -> Iterator[None]:
    """Turn :class:`CliError` and the library's bad-input exceptions into ``Error: ...`` and exit 2."""
    try:
        yield
    except CliError as err:
        if os.environ.get("GRADTRACE_DEBUG"):
            raise
        raise fail(str(err), err.exit_code) from None
    except _input_errors() as err:
        if os.environ.get("GRADTRACE_DEBUG"):
            raise
        message = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        raise fail(message) from None

"""Bad input ends a command with one clear line on stderr and exit code 2, never a traceback.

Commands raise :class:`CliError` for what they check themselves (missing files, wrong options); the
library's own input errors (a store that does not match, an unknown method, a corrupted file) are
reported the same way, and so is every ``OSError`` the machine raises (a full disk, a read-only file system, a
symbolic link loop, a permission): ``PATH: cause (ENOSPC); what to do`` (:func:`os_error_line`). Anything else is
a bug and keeps its traceback. Set ``GRADTRACE_DEBUG=1`` to see
the traceback of a reported error too.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager

import typer

from ..common.errors import BAD_INPUT_EXIT
from ..common.errors import UsageError as CliError

__all__ = ["BAD_INPUT_EXIT", "CliError", "fail", "os_error_line", "reported_errors"]

_ADVICE = {
    errno.ENOSPC: "free space there, or write elsewhere",
    errno.EDQUOT: "free space within your quota, or write elsewhere",
    errno.EROFS: "the file system is mounted read-only: write elsewhere",
    errno.ELOOP: "a symbolic link there points back at itself: give another path",
    errno.EACCES: "check the permissions, or write elsewhere",
    errno.EPERM: "check the permissions, or write elsewhere",
    errno.ENAMETOOLONG: "give a shorter path",
    errno.EMFILE: "raise the open-file limit (ulimit -n)",
    errno.EIO: "the device reported an I/O error: check the disk",
}


def fail(message: str, exit_code: int = BAD_INPUT_EXIT) -> typer.Exit:
    """Print ``Error: message`` on one line of stderr; returns the :class:`typer.Exit` to raise."""
    typer.secho(f"Error: {' '.join(str(message).split())}", err=True, fg="red")
    return typer.Exit(exit_code)


def os_error_line(err: OSError) -> str:
    """One line for an ``OSError``: the file(s) it names, the system's cause and its ``errno`` name, and what to do
    (``/data/s: No space left on device (ENOSPC); free space there, or write elsewhere``). An error without a file
    or an errno (the library's own ``FileNotFoundError("...")``) is its message."""
    if not err.errno or err.filename is None:
        return str(err)
    where = str(os.fsdecode(err.filename))
    if err.filename2 is not None:
        where += f" -> {os.fsdecode(err.filename2)}"
    name = errno.errorcode.get(err.errno, str(err.errno))
    advice = _ADVICE.get(err.errno)
    return f"{where}: {err.strerror or 'error'} ({name}){f'; {advice}' if advice else ''}"


def _input_errors() -> tuple[type[BaseException], ...]:
    from ..fit.methods import MissingStage
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
        raise fail(os_error_line(err) if isinstance(err, OSError) else message) from None
    except OSError as err:  # the machine's: a full disk, a read-only file system, a link loop, an I/O error
        if os.environ.get("GRADTRACE_DEBUG"):
            raise
        raise fail(os_error_line(err)) from None

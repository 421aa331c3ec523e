"""Bad input reported on one line: the error the commands (and what they share with the library) raise."""

from __future__ import annotations

__all__ = ["BAD_INPUT_EXIT", "UsageError", "first_line"]

BAD_INPUT_EXIT = 2


class UsageError(Exception):
    """Bad input found by a check (a missing file, a wrong option, a model directory without a tokenizer): the
    command line reports it as ``Error: <message>`` with exit code ``exit_code`` (``gradtrace.cli.errors.CliError``
    is this class)."""

    def __init__(self, message: str, exit_code: int = BAD_INPUT_EXIT) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__

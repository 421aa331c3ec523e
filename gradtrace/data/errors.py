"""The one exception of the data layer."""

from __future__ import annotations

__all__ = ["DataError"]


class DataError(ValueError):
    """Bad training or query data: the message names the source, the line or row (or id) and what to do.

    A ``ValueError``, so the command line reports it on one line (exit code 2) like the library's other
    bad-input errors. Raised while the data is read and tokenized, before anything is written to a store.
    """

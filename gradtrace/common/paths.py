"""Why a path the user gave cannot be used, in words: "does not exist" is not the only reason ``exists()`` is False.

``Path.exists()`` is also False for a symbolic link loop, a link to a missing target, and a path behind a folder
that cannot be entered; an error that said "does not exist" for those would send the user looking for the wrong
thing. :func:`why_missing` names the real cause.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["why_missing"]


def why_missing(path: str | os.PathLike[str]) -> str:
    """Why ``path`` (for which ``exists()`` is False) cannot be opened, as the end of a sentence about it:
    ``"does not exist"``, ``"is a symbolic link loop (ELOOP)"``, ``"is a symbolic link to /x, which does not
    exist"``, ``"cannot be reached (Permission denied, EACCES)"``."""
    path = Path(path)
    try:
        os.stat(path)
    except FileNotFoundError:
        if path.is_symlink():
            return f"is a symbolic link to {os.readlink(path)}, which does not exist"
        return "does not exist"
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "is a symbolic link loop (ELOOP)"
        name = errno.errorcode.get(err.errno or 0, "")
        return f"cannot be reached ({err.strerror or err}{f', {name}' if name else ''})"
    return "exists"  # it appeared in between

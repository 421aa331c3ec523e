"""Input files checked before they are opened, and data files checked against the fingerprint a run recorded.

* :func:`check_input`: a path given as data, queries or a config file must be a regular file (or, where one is
  expected, a directory). A FIFO, a socket or a device (``/dev/zero``, ``/dev/stdin``) is refused before it is
  opened: reading one blocks forever or never ends, and gradtrace reads an input more than once (to count it,
  to tokenize it, to fingerprint it).
* :func:`data_changed`: whether a data file still holds the bytes a command recorded when it read it
  (``gradtrace collect`` records the training data's size and blake2b hash in the store's manifest,
  ``gradtrace score`` the queries'; :func:`gradtrace.common.provenance.file_fingerprint`). The size is compared first;
  the hash is computed (streamed, bounded memory) only when the sizes agree, once per file state and process.
  :func:`warn_if_changed` turns a change into a :class:`DataChangedWarning` (texts shown beside scores);
  the commands that re-capture gradients from the file refuse it instead.
"""

from __future__ import annotations

import os
import stat
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import DataError

__all__ = ["DataChangedWarning", "check_input", "check_tree", "data_changed", "recorded_fingerprint",
           "warn_if_changed"]

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


class DataChangedWarning(UserWarning):
    """A data file no longer holds the bytes recorded when it was collected or scored: the texts shown beside
    the scores may not be the examples scored."""


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_input(path: str | os.PathLike[str], what: str, *, directory: bool = False) -> os.stat_result:
    """The ``stat`` of input ``path`` (``what`` names it in messages: "data file", "config file"), refused with a
    :class:`DataError` unless it is a regular file, or a directory where ``directory`` allows one. Symbolic links
    are followed; nothing is opened."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise DataError(f"{what} {path} does not exist") from None
    except OSError as err:
        raise DataError(f"{what} {path} cannot be read ({err.strerror or type(err).__name__})") from None
    if stat.S_ISREG(info.st_mode) or (directory and stat.S_ISDIR(info.st_mode)):
        return info
    if stat.S_ISDIR(info.st_mode):
        raise DataError(f"{what} {path} is a directory; give a file")
    expected = "a regular file or a directory" if directory else "a regular file"
    raise DataError(f"{what} {path} is {_kind(info.st_mode)}, not {expected}: reading one may block or never end "
                    "(and gradtrace reads an input more than once); copy what it holds into a file and give that")


def check_tree(root: Path, what: str) -> None:
    """Every entry under directory ``root`` is a regular file or a directory (a ``save_to_disk`` dataset whose
    Arrow file was replaced by a FIFO would hang its reader)."""
    for folder, dirs, names in os.walk(root):
        for name in (*dirs, *names):
            entry = Path(folder) / name
            mode = os.stat(entry).st_mode if entry.exists() else 0
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                kind = _kind(mode) if mode else "a broken link"
                raise DataError(f"{what} {root} holds {entry.relative_to(root)}, which is {kind}: a dataset "
                                "directory holds regular files only")


def recorded_fingerprint(recorded: Mapping[str, Any]) -> dict[str, Any] | None:
    """The data fingerprint (``path``, ``bytes``, ``blake2b``) in a command's recorded configuration (the
    ``gradtrace`` provenance block of a store manifest's or scores' ``config``), None when there is none."""
    block = recorded.get("gradtrace")
    data = block.get("data") if isinstance(block, Mapping) else None
    if isinstance(data, Mapping) and isinstance(data.get("blake2b"), str) and isinstance(data.get("bytes"), int):
        return dict(data)
    return None


_DIGESTS: dict[tuple[Any, ...], str] = {}  # (path, the stat of every file) -> blake2b: one hash per file state


def _state(path: Path) -> tuple[int, tuple[Any, ...]]:
    """``(total bytes, a key of the files' current state)`` of a file or a directory's files."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    stats = [(str(p), p.stat()) for p in files]
    return (sum(s.st_size for _, s in stats),
            (str(path), *((name, s.st_size, s.st_mtime_ns, s.st_ino, s.st_dev) for name, s in stats)))


def data_changed(path: str | os.PathLike[str], recorded: Mapping[str, Any]) -> str | None:
    """How data file (or ``save_to_disk`` directory) ``path`` differs from the fingerprint ``recorded`` holds
    (:func:`recorded_fingerprint`), or None when it holds the same bytes (or nothing is recorded)."""
    from ..common.provenance import file_fingerprint

    fingerprint = recorded_fingerprint(recorded)
    path = Path(path)
    if fingerprint is None or not path.exists():
        return None
    size, key = _state(path)
    if size != fingerprint["bytes"]:
        return f"it holds {size:,} bytes, {fingerprint['bytes']:,} were recorded"
    if key not in _DIGESTS:
        _DIGESTS[key] = file_fingerprint(path)["blake2b"]
    if _DIGESTS[key] != fingerprint["blake2b"]:
        return "same size, but its content hash is not the recorded one"
    return None


def warn_if_changed(path: str | os.PathLike[str], recorded: Mapping[str, Any], what: str) -> None:
    """A :class:`DataChangedWarning` naming ``path`` when it no longer holds the recorded bytes (``what``: "training
    data", "queries")."""
    change = data_changed(path, recorded)
    if change is None:
        return
    command = (recorded.get("gradtrace") or {}).get("command") or "the run"
    read = f"`gradtrace {command}` read it" if command != "the run" else "it was recorded"
    warnings.warn(f"{what} {path} changed since {read} ({change}): the texts shown may not be those of the "
                  "examples it held then", DataChangedWarning, stacklevel=2)

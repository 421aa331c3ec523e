"""Every output of a command checked before any model work: never overwritten without ``--overwrite``, never
inside a gradient store or another artifact, writable, not locked by a live run.

A command calls :func:`check_output_dir` for the artifact directory it saves (``score --out``, ``fit --out``,
``index --out``) and :func:`check_output_file` for each file it writes (``score --export``, ``report --out``,
``self-influence --out``), all before it opens a model or a store. Each refusal is a :class:`CliError`: one line
naming the flag, the path and what to do. The saves themselves check again under the directory's write lock
(:func:`gradtrace.store.artifact.write_artifact`), so a run that starts between the check and the save is still
refused rather than overwritten.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

from .errors import CliError

__all__ = ["check_output_dir", "check_output_file", "check_writable", "resolved_output"]


def resolved_output(path: Path, flag: str) -> Path:
    """``path`` with its symbolic links followed; a loop, an over-long name or a parent that is a file is refused
    (a path that does not exist yet is fine)."""
    try:
        os.stat(path)
    except FileNotFoundError:
        pass
    except OSError as err:
        name = errno.errorcode.get(err.errno or 0, "")
        cause = "a symbolic link loop" if err.errno == errno.ELOOP else (err.strerror or str(err))
        if err.errno == errno.ENOTDIR:
            blocking = next((p for p in Path(path).absolute().parents if p.exists() and not p.is_dir()), None)
            cause = f"{blocking} is a file, not a directory" if blocking is not None else cause
        raise CliError(f"{flag} {path}: {cause}{f' ({name})' if name else ''}; choose another {flag}") from None
    return Path(os.path.realpath(path))


def check_writable(path: Path, flag: str) -> None:
    """Refuse an output whose folder cannot be written: a temporary file is created (and removed) in the folder
    that would hold ``path`` -- or in its nearest existing parent when it does not exist yet; nothing is left."""
    folder = Path(path).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        if not folder.is_dir():
            raise NotADirectoryError(f"{folder} is not a directory")
        handle, probe = tempfile.mkstemp(prefix=".tmp-gradtrace-probe-", dir=folder)
        os.close(handle)
        os.unlink(probe)
    except OSError as err:
        raise CliError(f"cannot write {flag} {path}: {folder} is not writable ({err.strerror or err}); choose another "
                       f"{flag} or fix the directory's permissions") from None


def check_output_file(path: Path, flag: str, *, overwrite: bool, own: Path | None = None) -> None:
    """Refuse, before any work, a file output that would overwrite an existing file without ``--overwrite``, that
    is not a regular file (a directory, a FIFO, a device), that lies inside a gradient store or another artifact
    (``own``: the directory of this command's own artifact, where it may go under a name no artifact uses), or
    whose folder is not writable."""
    from ..store.artifact import ArtifactError, refuse_inside_artifact

    path = Path(path)
    target = resolved_output(path, flag)
    if target.exists():
        mode = target.stat().st_mode
        if stat.S_ISDIR(mode):
            raise CliError(f"{flag} {path} is a directory; give a file name")
        if not stat.S_ISREG(mode):
            raise CliError(f"{flag} {path} is not a regular file (a FIFO, socket or device); give a file name")
        if not overwrite:
            raise CliError(f"{flag} {path} already exists: pass --overwrite to replace it, or choose another file")
    try:
        refuse_inside_artifact(path, flag, own=own)
    except ArtifactError as err:
        raise CliError(str(err)) from None
    check_writable(target.parent, flag)


def check_output_dir(path: Path, flag: str, *, stem: str, what: str, overwrite: bool,
                     also: tuple[str, ...] = ()) -> None:
    """Refuse, before any work, an artifact directory that already holds ``what`` (``stem.json``, or one of the
    ``also`` stems) without ``--overwrite``, that is a gradient store or another kind of artifact or lies inside
    one, that another live run is writing, or that cannot be written."""
    from ..store.artifact import ARTIFACT_MANIFESTS, ArtifactError, artifact_kind, refuse_inside_artifact
    from ..store.locking import DIRECTORY_LOCK, describe, lock_is_stale, read_holder

    path = Path(path)
    target = resolved_output(path, flag)
    if target.exists() and not target.is_dir():
        raise CliError(f"{flag} {path} exists and is not a directory")
    if target.is_dir():
        mine = {f"{name}.json" for name in (stem, *also)}
        kind = artifact_kind(target)
        held = [name for name in mine if (target / name).exists()]
        if kind is not None and not held:
            others = [name for name in ARTIFACT_MANIFESTS if (target / name).exists() and name not in mine]
            raise CliError(f"{flag} {path} is {kind} ({', '.join(others)}); save {what} in another directory")
        if held and not overwrite:
            raise CliError(f"{path} already holds {what}: pass --overwrite to replace it")
        holder = read_holder(target / DIRECTORY_LOCK)
        if holder and not lock_is_stale(holder):
            raise CliError(f"{flag} {path} is being written by another run ({describe(holder)}); wait for it or "
                           f"write elsewhere (if that run is gone, delete {target / DIRECTORY_LOCK})")
    try:
        refuse_inside_artifact(target, flag)
    except ArtifactError as err:
        raise CliError(str(err)) from None
    check_writable(target, flag)

"""Atomic file primitives every gradtrace artifact is written with: a temporary file of its own, fsync, one
rename (readers see all or nothing), and exclusive creation (locks, store records)."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_output", "atomic_write_bytes", "atomic_write_json", "create_exclusive", "fsync_dir", "naming",
           "temporary_name", "write_synced"]


def fsync_dir(path: Path) -> None:
    """Fsync a directory (a rename inside it is durable after this); best effort where it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_synced(handle: IO[bytes], data: bytes | memoryview) -> None:
    """Write ``data`` to an open file and flush it to the disk."""
    handle.write(data)
    handle.flush()
    os.fsync(handle.fileno())


def temporary_name(path: Path) -> Path:
    """A temporary file beside ``path`` that no other writer uses (pid, thread and a random part)."""
    return path.with_name(f".tmp-{path.name}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex[:8]}")


@contextlib.contextmanager
def atomic_output(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write a file to; on success it is fsynced and renamed to
    ``path`` in one step, so a reader (or a crash, or a full disk) sees the old file or the whole new one, never
    a part. On an exception the temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        raise naming(err, path, tmp) from err
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def naming(err: OSError, path: Path, tmp: Path | None = None) -> OSError:
    """``err`` naming ``path``, the file the user asked for, where it names no file or the temporary one ``tmp``
    (a full disk while writing ``.tmp-scores...`` is reported as a full disk writing the scores)."""
    if err.errno and (err.filename is None or (tmp is not None and os.fsdecode(err.filename) == str(tmp))):
        return type(err)(err.errno, err.strerror or os.strerror(err.errno), str(path))
    return err


def atomic_write_bytes(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` via a temporary file of its own, fsync, rename: readers see all or nothing."""
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        write_synced(f, data)


def atomic_write_json(path: Path, data: Any) -> None:
    """:func:`atomic_write_bytes` of the JSON document ``data`` (indented as a store writes its records)."""
    atomic_write_bytes(path, json.dumps(data, indent=1, sort_keys=False).encode())


def create_exclusive(path: Path, data: bytes) -> bool:
    """Create ``path`` holding ``data`` unless it exists; False if it did. Other processes never see the
    file half-written: the content is written to a temporary file first and hard-linked into place."""
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as f:
            write_synced(f, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:  # no hard links on this file system: exclusive create, then write (not atomic)
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                write_synced(f, data)
    except OSError as err:
        raise naming(err, path, tmp) from err
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True

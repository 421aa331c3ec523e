"""Write locks: one writer at a time for a gradient store's rank and for every artifact directory.

A lock is a small JSON file, created whole and exclusively (:func:`gradtrace.store.atomic.create_exclusive`:
written aside, then hard-linked into place), naming its holder: ``{"pid", "host", "token", "what", "since"}``.
A second writer finds the file and is refused with :class:`LockedError`, naming the first. A lock whose process
is gone (same host, pid not running) is taken over -- under an ``flock`` of the directory, so two runs finding
the same stale lock cannot both take it. A lock is removed by the holder that took it (its ``token``), also
when the work inside it raised.

Gradient stores lock per rank (``STORE/rank-00000.lock``, :func:`gradtrace.store.layout.acquire_lock`);
scores, curvature, method fits and indexes lock their directory (``DIR/.gradtrace-write.lock``,
:func:`directory_lock`) for the whole of a save: the check that nothing would be overwritten, the writes, the
publishing rename and the clean-up of the files the previous save left.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .atomic import create_exclusive

__all__ = ["DIRECTORY_LOCK", "LockedError", "acquire", "directory_lock", "lock_is_stale", "read_holder", "release"]

DIRECTORY_LOCK = ".gradtrace-write.lock"
"""The lock file of an artifact directory (scores, curvature, method fit, index)."""


class LockedError(RuntimeError):
    """Another process is writing the same store rank or artifact directory."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_holder(path: Path) -> dict[str, Any] | None:
    """The holder recorded in lock file ``path``, ``{}`` when it is unreadable, None when there is no lock."""
    try:
        holder = json.loads(path.read_text() or "{}")
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def lock_is_stale(holder: dict[str, Any]) -> bool:
    """Whether a lock was left by a process of this host that no longer runs."""
    pid = holder.get("pid")
    return holder.get("host") == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid)


@contextmanager
def _takeover_guard(directory: Path) -> Iterator[None]:
    """Serialize stale-lock takeovers on this host. Best effort where the file system has no ``flock``."""
    fd = None
    try:
        import fcntl

        fd = os.open(directory, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
    except (ImportError, OSError):
        pass
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the flock


def describe(holder: dict[str, Any]) -> str:
    """``pid 123 on host (since 2026-12-02T08:00:00Z)`` for a lock's holder."""
    since = f" since {holder['since']}" if holder.get("since") else ""
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}{since}"


def acquire(path: Path, what: str, refusal: str) -> str:
    """Take the lock file ``path`` for writing ``what``; returns the token that releases it.

    ``refusal``: the sentence of the :class:`LockedError` raised when another live process holds it, with
    ``{holder}`` where the holder's pid and host go. A lock left by a dead process of this host is taken over.
    """
    token = uuid.uuid4().hex
    me = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "token": token, "what": what,
                     "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode()
    for _ in range(5):
        if create_exclusive(path, me):
            return token
        holder = read_holder(path)
        if holder is None:
            continue  # released meanwhile
        if lock_is_stale(holder):
            with _takeover_guard(path.parent):
                if read_holder(path) == holder:  # still the dead process's lock, not a new taker's
                    path.unlink(missing_ok=True)
            continue
        raise LockedError(refusal.format(holder=describe(holder)) + f" If that run is gone, delete {path}.")
    raise LockedError(f"could not take the write lock {path}")


def release(path: Path, token: str | None = None) -> None:
    """Remove lock file ``path`` if this process holds it (and, given ``token``, under that token)."""
    holder = read_holder(path)
    if not holder or holder.get("pid") != os.getpid() or holder.get("host") != socket.gethostname():
        return
    if token is not None and holder.get("token") not in (None, token):
        return
    path.unlink(missing_ok=True)


_local = threading.local()
"""``_local.held``: the directories this thread holds the lock of, and how deeply (a save inside a save of the
same directory)."""


@contextmanager
def directory_lock(directory: str | Path, what: str) -> Iterator[Path]:
    """Hold ``directory``'s write lock (creating the directory) while the block runs; yields the directory.

    A second writer -- another process, or another thread of this one -- is refused with :class:`LockedError`
    naming the first. Re-entrant within one thread: a save that calls another save of the same
    directory (a method fit saving its curvature beside it) holds one lock.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    key = str(directory.resolve())
    if getattr(_local, "pid", None) != os.getpid():  # a forked child holds none of its parent's locks
        _local.pid, _local.held = os.getpid(), {}
    _held: dict[str, int] = _local.held
    if _held.get(key):
        _held[key] += 1
        try:
            yield directory
        finally:
            _held[key] -= 1
        return
    path = directory / DIRECTORY_LOCK
    token = acquire(path, what, f"{directory} is being written by another run ({{holder}}, saving {what}); "
                                "two runs cannot write the same directory: wait for it or write elsewhere.")
    _held[key] = 1
    try:
        yield directory
    finally:
        _held.pop(key, None)
        release(path, token)
